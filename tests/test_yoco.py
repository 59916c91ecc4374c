"""YoCo prefill truncation (docs/design.md section 10), single process.

Named hand-worked cases, exact comparison with the literal reference (tests/reference_yoco.py) on
random batches, view semantics (shared objects, nothing modified), the truncation's meaning (a
kept row sees exactly the untruncated keys at positions >= rect_lo), and compact + CP with every
rank computed in a loop in tests/test_yoco_cp.py (multi-process: tests/test_yoco_multirank.py).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpmeta
from cpmeta import MetadataConfig, SequenceMetadata
from cpmeta.builders.yoco import YOCO_COMPACT_FIELDS
from cpmeta.cp.yoco_views import get_consumer_view
from cpmeta.fields import consumer_cleared
from cpmeta.metadata import FIELDS
from reference_yoco import ref_consumer_rows, ref_yoco_fields
from strategies import prompt_cases, random_config, random_prompt_batch

I32 = torch.int32
#: docs/design.md section 10: what a consumer view sets to None (the table may clear more, only fields None on prompt metadata)
CONSUMER_CLEARED = {"kv_ca_index", "kv_ca_index_len", "klen", "kv_swa_full_index"}
CONSUMER_REPLACED = (
    "positions", "cu_seqlens_q", "total_q", "max_seqlen_q", "query_indices", "slot_mapping_store_swa",
    "ks", "ke", "kv_ca_index_offset_len", "kv_swa_full_index_pivots",
)
MIRRORED_VIEW_FIELDS = (
    "mirror_cp_index", "mirror_cp_reverse_index", "cp_mirror_len", "positions", "positions_cp",
    "valid_token_mask", "ks", "ke",
)
MAX_EXAMPLES = 60


# ---- helpers --------------------------------------------------------------------------------


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _cfg(k: int | None, mode: str = "compact", **kw: Any) -> MetadataConfig:
    base = dict(block_size=8, window_size=4, swa_block_size=4, dense_compress_ratios=(4,),
                sparse_compress_ratios=(2,), max_model_len=64)
    base.update(kw)
    return MetadataConfig(yoco_keep_tokens=k, yoco_mode=mode, **base)


def _seq(prompt: int, q_start: int, q_len: int, state: int = 3, **kw: Any) -> SequenceMetadata:
    """A chunk ``[q_start, q_start + q_len)`` of a ``prompt``-token prompt (token t has id 100 + t)."""
    return SequenceMetadata(seqlen_q=q_len, seqlen_k=q_start + q_len, block_table=list(range(10, 18)),
                            state_id=state, token_ids=[100 + t for t in range(prompt)], **kw)


def _with_yoco(cfg: MetadataConfig, k: int, mode: str) -> MetadataConfig:
    return dataclasses.replace(cfg, yoco_keep_tokens=k, yoco_mode=mode)


def _snapshot(md: cpmeta.InputMetadata) -> dict[str, Any]:
    return {p: (v.clone() if isinstance(v, torch.Tensor) else v) for p, v in md.to_flatten_dict().items()}


def _assert_unchanged(md: cpmeta.InputMetadata, snap: dict[str, Any]) -> None:
    now = md.to_flatten_dict()
    assert set(now) == set(snap)
    for p, v in snap.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(now[p], v), f"{p} was modified through a view"
        else:
            assert now[p] == v, f"{p} changed: {now[p]!r} vs {v!r}"


def _assert_matches_reference(md: cpmeta.InputMetadata, seqs: list[SequenceMetadata], cfg: MetadataConfig) -> None:
    for name, want in ref_yoco_fields(seqs, cfg).items():
        got = getattr(md, name)
        assert _plain(got) == want, f"{name}: {_plain(got)} vs reference {want}"
        if isinstance(got, torch.Tensor):
            assert got.dtype == I32, name


# ---- named hand-worked cases ----------------------------------------------------------------
# W = 4, S = 4, state 3 (SWA slots 12 + pos % 4), sparse ratio 2, dense ratio 4, one sequence:
# sec1_start = 0, sec2_start = 1 * 4 + 0 = 4.


def test_k_smaller_than_prompt_compact() -> None:
    """Prompt 10, chunk [2, 8), k = 6: rect_lo = 4, clip_prefix = 2, kept positions 4..7."""
    cfg, seqs = _cfg(6), [_seq(10, 2, 6)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    assert md.yoco_mask_swa_index_pivots is None
    assert md.yoco_consumer_cu_seqlens_q.tolist() == [0, 4]
    assert md.yoco_consumer_total_q == 4
    assert md.yoco_consumer_query_indices.tolist() == [2, 3, 4, 5]
    assert md.yoco_consumer_positions.tolist() == [4, 5, 6, 7]
    assert md.yoco_consumer_slot_mapping_store_swa.tolist() == [12, 13, 14, 15]
    assert md.yoco_consumer_ks["2"].tolist() == [0, 0, 0, 0]
    assert md.yoco_consumer_ke["2"].tolist() == [2, 3, 3, 4]  # (pos + 1) // 2
    assert md.yoco_consumer_kv_ca_index_offset_len["4"].tolist() == [[0, 1], [0, 1], [0, 1], [0, 2]]
    # every kept row sees from rect_lo = 4: no history (P1 = 0), chunk rows from k_lo = 2
    assert md.yoco_consumer_kv_swa_full_index_pivots.tolist() == [
        [4, 0, 6, 1], [4, 0, 6, 2], [4, 0, 6, 3], [4, 0, 6, 4]]
    # the untruncated row at pos 4 saw history position 1 and chunk positions 2..4
    assert md.kv_swa_full_index_pivots[2].tolist() == [3, 1, 4, 3]
    view = md.get_consumer_view().compute_attn_info(cfg)
    assert view.kv_swa_full_index.tolist() == [[6, -1, -1, -1], [6, 7, -1, -1], [6, 7, 8, -1], [6, 7, 8, 9]]
    assert view.max_seqlen_q == 4 and view.total_q == 4


def test_k_smaller_than_prompt_mask() -> None:
    """Same chunk in mask mode: all 6 rows kept; rows 0, 1 (pos 2, 3 < rect_lo) see nothing."""
    cfg, seqs = _cfg(6, "mask"), [_seq(10, 2, 6)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    assert all(getattr(md, f) is None for f in YOCO_COMPACT_FIELDS)
    assert md.yoco_mask_swa_index_pivots.tolist() == [
        [4, 0, 5, 0], [4, 0, 6, 0], [4, 0, 6, 1], [4, 0, 6, 2], [4, 0, 6, 3], [4, 0, 6, 4]]
    view = md.get_mask_view().compute_attn_info(cfg)
    assert view.kv_swa_full_index.tolist() == [
        [-1] * 4, [-1] * 4, [6, -1, -1, -1], [6, 7, -1, -1], [6, 7, 8, -1], [6, 7, 8, 9]]


@pytest.mark.parametrize("k", [10, 11, 100])
@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_k_equal_or_larger_than_prompt_keeps_everything(k: int, mode: str) -> None:
    """k >= prompt: rect_lo = 0, every row kept, visibility untouched."""
    cfg, seqs = _cfg(k, mode), [_seq(10, 2, 6, swa_valid_start=1), _seq(10, 0, 10, state=5)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    if mode == "mask":
        assert torch.equal(md.yoco_mask_swa_index_pivots, md.kv_swa_full_index_pivots)
        return
    view = md.get_consumer_view()
    assert view.total_q == md.yoco_consumer_total_q == 16
    assert md.yoco_consumer_query_indices.tolist() == list(range(16))
    for name in ("positions", "cu_seqlens_q", "slot_mapping_store_swa", "kv_swa_full_index_pivots"):
        assert torch.equal(getattr(view, name), getattr(md, name)), name
    for name in ("ks", "ke", "kv_ca_index_offset_len"):
        for key, t in getattr(md, name).items():
            assert torch.equal(getattr(view, name)[key], t), f"{name}.{key}"


def test_chunk_entirely_before_rectangle_keeps_last_row() -> None:
    """Prompt 10, chunk [0, 3), k = 6 (rect_lo = 4): only row 2 (pos 2) is kept; it sees no SWA
    key and writes no SWA slot, but its ks/ke and compressed offsets keep their full values."""
    cfg, seqs = _cfg(6), [_seq(10, 0, 3)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    assert md.yoco_consumer_cu_seqlens_q.tolist() == [0, 1]
    assert md.yoco_consumer_query_indices.tolist() == [2]
    assert md.yoco_consumer_positions.tolist() == [2]
    assert md.slot_mapping_store_swa[2].item() == 14  # the full layer writes it ...
    assert md.yoco_consumer_slot_mapping_store_swa.tolist() == [-1]  # ... the consumer does not
    assert md.yoco_consumer_kv_swa_full_index_pivots.tolist() == [[4, 0, 7, 0]]
    assert md.yoco_consumer_ks["2"].tolist() == [0] and md.yoco_consumer_ke["2"].tolist() == [1]
    assert md.yoco_consumer_kv_ca_index_offset_len["4"].tolist() == [[0, 0]]
    view = md.get_consumer_view().compute_attn_info(cfg)
    assert view.kv_swa_full_index.tolist() == [[-1, -1, -1, -1]]


def test_swa_valid_start_above_rect_lo() -> None:
    """Prompt 10, chunk [2, 8), k = 6 (rect_lo = 4), swa_valid_start = 6: the larger bound wins
    (visibility from 6), while the kept rows and SWA writes still follow rect_lo."""
    cfg, seqs = _cfg(6), [_seq(10, 2, 6, swa_valid_start=6)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    assert md.yoco_consumer_positions.tolist() == [4, 5, 6, 7]
    assert md.yoco_consumer_slot_mapping_store_swa.tolist() == [12, 13, 14, 15]
    assert md.yoco_consumer_kv_swa_full_index_pivots.tolist() == [
        [4, 0, 7, 0], [4, 0, 8, 0], [4, 0, 8, 1], [4, 0, 8, 2]]


def test_two_sequences_offsets() -> None:
    """Sequence offsets: s = 1 has sec1_start = 4, sec2_start = 2*4 + cu_seqlens_q[1] = 14;
    compact rows of s = 1 index full rows 6.. (cu_seqlens_q[1] = 6); ks base of s = 1 is
    max(1, 8 // 2) = 4."""
    cfg, seqs = _cfg(6), [_seq(10, 2, 6), _seq(7, 3, 4, state=1)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    # s = 1: prompt 7, rect_lo = 1, chunk [3, 7), clip 0 -> all 4 rows kept (pos 3..6)
    assert md.yoco_consumer_cu_seqlens_q.tolist() == [0, 4, 8]
    assert md.yoco_consumer_query_indices.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert md.yoco_consumer_ks["2"].tolist() == [0] * 4 + [4] * 4
    assert md.yoco_consumer_ke["2"].tolist() == [2, 3, 3, 4, 6, 6, 7, 7]
    # s = 1, j = 0 (pos 3): abs_lo = max(3 - 3, rect_lo 1) = 1, start_slot = 1 - (3 - 4) = 2
    # -> P0 = 4 + 2, P1 = 2 (history 1, 2); untruncated it would be abs_lo 0 -> (5, 3, 14, 1).
    # j = 1..3: abs_lo = pos - 3 = 1, 2, 3 (the window binds) -> start_slot 2, 3, 4.
    assert md.yoco_consumer_kv_swa_full_index_pivots[4:].tolist() == [
        [6, 2, 14, 1], [6, 2, 14, 2], [7, 1, 14, 3], [8, 0, 14, 4]]
    assert md.kv_swa_full_index_pivots[6].tolist() == [5, 3, 14, 1]
    _assert_matches_reference(md, seqs, cfg)


def test_visibility_helper_docstring_example() -> None:
    import numpy as np

    from cpmeta.builders.prompt_njit import pivot_rows

    for lower, want in ((0, [6, 2, 11, 2]), (6, [8, 0, 12, 1]), (9, [8, 0, 13, 0])):
        got = np.zeros(4, np.int32)
        pivot_rows(got, 1, 1, 2, 5, lower, 4, 11)  # W = 4, s = 1, q0 = 5, sec2 = 11, row j = 1 (pos 6)
        assert got.tolist() == want, lower


def test_off_leaves_every_yoco_field_none() -> None:
    md = cpmeta.prepare_prompt([_seq(10, 2, 6)], _cfg(None))
    for name in md.field_names():
        if name.startswith("yoco_"):
            assert getattr(md, name) is None, name
    with pytest.raises(ValueError, match="yoco_consumer_cu_seqlens_q"):
        md.get_consumer_view()
    with pytest.raises(ValueError, match="yoco_mask_swa_index_pivots"):
        md.get_mask_view()


def test_view_of_the_other_mode_is_an_error() -> None:
    seqs = [_seq(10, 2, 6)]
    with pytest.raises(ValueError, match="yoco_mask_swa_index_pivots"):
        cpmeta.prepare_prompt(seqs, _cfg(6, "compact")).get_mask_view()
    with pytest.raises(ValueError, match="yoco_consumer_cu_seqlens_q"):
        cpmeta.prepare_prompt(seqs, _cfg(6, "mask")).get_consumer_view()
    with pytest.raises(TypeError, match="md"):
        get_consumer_view("not metadata")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "8"])
def test_config_validation_keep_tokens(bad: Any) -> None:
    with pytest.raises(ValueError, match="yoco_keep_tokens"):
        MetadataConfig.compressed_swa(yoco_keep_tokens=bad)


@pytest.mark.parametrize("bad", ["Mask", "full", None])
def test_config_validation_mode(bad: Any) -> None:
    with pytest.raises(ValueError, match="yoco_mode"):
        MetadataConfig.compressed_swa(yoco_keep_tokens=4, yoco_mode=bad)


def test_build_rejects_a_short_prompt() -> None:
    short = [_seq(10, 2, 6)]
    short[0].token_ids = short[0].token_ids[:7]  # fewer than seqlen_k = 8
    with pytest.raises(ValueError, match=r"seqs\[0\].token_ids"):
        cpmeta.prepare_prompt(short, _cfg(6))


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_out_buffers_are_refilled_in_place(mode: str) -> None:
    cfg, seqs = _cfg(6, mode), [_seq(10, 2, 6), _seq(7, 3, 4, state=1)]
    out: dict[str, torch.Tensor] = {}
    first = cpmeta.prepare_prompt(seqs, cfg, out=out)
    names = [p for p, v in first.tensors() if p.startswith("yoco_")]
    assert names and all(p in out for p in names)
    ptrs = {p: v.data_ptr() for p, v in first.tensors() if p.startswith("yoco_")}
    for t in out.values():
        t.fill_(-7)
    again = cpmeta.prepare_prompt(seqs, cfg, out=out)
    assert {p: v.data_ptr() for p, v in again.tensors() if p.startswith("yoco_")} == ptrs
    _assert_matches_reference(again, seqs, cfg)


# ---- random batches against the reference ---------------------------------------------------


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(case=prompt_cases({"yoco_keep_tokens": 1}, whole_prompt=True), k=st.integers(1, 80), mode=st.sampled_from(["mask", "compact"]))
def test_random_batches_match_reference(case: Any, k: int, mode: str) -> None:
    cfg, seqs = case
    cfg = _with_yoco(cfg, k, mode)
    md = cpmeta.prepare_prompt(seqs, cfg)
    _assert_matches_reference(md, seqs, cfg)
    if mode == "compact":
        view = md.get_consumer_view()
        for name, want in ref_consumer_rows(seqs, cfg).items():
            assert _plain(getattr(view, name)) == want, name


# ---- views: shared objects, nothing modified, meaning of the truncation ---------------------


def _case(seed: int, mode: str, k: int | None = None) -> tuple[MetadataConfig, list[SequenceMetadata]]:
    rng = random.Random(seed)
    cfg = random_config(rng, yoco_keep_tokens=1)  # a config YoCo accepts (window_size > 0)
    cfg = _with_yoco(cfg, k if k is not None else rng.choice([1, 3, 8, 20, 60]), mode)
    return cfg, random_prompt_batch(rng, cfg, whole_prompt=True)


@pytest.mark.parametrize("seed", range(8))
def test_consumer_view_shares_everything_else_and_modifies_nothing(seed: int) -> None:
    cfg, seqs = _case(seed, "compact")
    md = cpmeta.prepare_prompt(seqs, cfg).compute_attn_info(cfg)  # derived fields present
    snap = _snapshot(md)
    view = md.get_consumer_view()
    assert view is not md
    cleared = set(consumer_cleared(FIELDS))  # the view's rule, from the field table
    assert CONSUMER_CLEARED <= cleared and all(getattr(md, n) is None for n in cleared - CONSUMER_CLEARED)
    for name in cleared:
        assert getattr(view, name) is None, name
    swapped = {
        "positions": md.yoco_consumer_positions, "cu_seqlens_q": md.yoco_consumer_cu_seqlens_q,
        "query_indices": md.yoco_consumer_query_indices, "ks": md.yoco_consumer_ks,
        "slot_mapping_store_swa": md.yoco_consumer_slot_mapping_store_swa, "ke": md.yoco_consumer_ke,
        "kv_ca_index_offset_len": md.yoco_consumer_kv_ca_index_offset_len,
        "kv_swa_full_index_pivots": md.yoco_consumer_kv_swa_full_index_pivots,
    }
    for name, obj in swapped.items():
        assert getattr(view, name) is obj, name
    assert view.total_q == md.yoco_consumer_total_q
    assert view.max_seqlen_q == int((md.yoco_consumer_cu_seqlens_q.diff()).max())
    for name in md.field_names():
        if name not in CONSUMER_REPLACED and name not in cleared:
            assert getattr(view, name) is getattr(md, name), name
    view.compute_attn_info(cfg)
    md.get_consumer_view().compute_attn_info(cfg)
    _assert_unchanged(md, snap)
    # expanded compact rows = full expansion at the kept rows for the compressed KV
    rows = md.yoco_consumer_query_indices.long()
    for key, idx in (md.kv_ca_index or {}).items():  # None without compressed KV
        assert torch.equal(view.kv_ca_index[key], idx[rows]), key
        assert torch.equal(view.kv_ca_index_len[key], md.kv_ca_index_len[key][rows]), key


@pytest.mark.parametrize("seed", range(8))
def test_mask_view_shares_everything_else_and_modifies_nothing(seed: int) -> None:
    cfg, seqs = _case(seed, "mask")
    md = cpmeta.prepare_prompt(seqs, cfg).compute_attn_info(cfg)
    snap = _snapshot(md)
    view = md.get_mask_view()
    assert view.kv_swa_full_index_pivots is md.yoco_mask_swa_index_pivots
    assert view.kv_swa_full_index is None
    for name in md.field_names():
        if name not in ("kv_swa_full_index_pivots", "kv_swa_full_index"):
            assert getattr(view, name) is getattr(md, name), name
    view.compute_attn_info(cfg)
    _assert_unchanged(md, snap)


@pytest.mark.parametrize("seed", range(12))
def test_truncation_drops_exactly_the_keys_before_rect_lo(seed: int) -> None:
    """Meaning of section 10: a row's YoCo SWA keys are its untruncated keys at positions >= rect_lo
    (same buffer rows, same order); mask and compact agree on every kept row."""
    cfg, seqs = _case(seed, "mask")
    mask_md = cpmeta.prepare_prompt(seqs, cfg).compute_attn_info(cfg)
    full_idx = mask_md.kv_swa_full_index
    mask_idx = mask_md.get_mask_view().compute_attn_info(cfg).kv_swa_full_index
    ccfg = _with_yoco(cfg, cfg.yoco_keep_tokens, "compact")
    cmd = cpmeta.prepare_prompt(seqs, ccfg)
    comp_idx = cmd.get_consumer_view().compute_attn_info(ccfg).kv_swa_full_index
    assert torch.equal(comp_idx, mask_idx[cmd.yoco_consumer_query_indices.long()])
    W, n_seq = cfg.window_size, len(seqs)
    row = 0
    for s, seq in enumerate(seqs):
        q_start = seq.seqlen_k - seq.seqlen_q
        rect_lo = max(0, len(seq.token_ids) - cfg.yoco_keep_tokens)
        chunk_base = n_seq * W + int(mask_md.cu_seqlens_q[s])

        def abs_pos(buf: int) -> int:  # buffer row -> absolute key position
            return q_start - W + (buf - s * W) if buf < n_seq * W else q_start + (buf - chunk_base)

        for _j in range(seq.seqlen_q):
            full = [b for b in full_idx[row].tolist() if b >= 0]
            want = [b for b in full if abs_pos(b) >= rect_lo]
            assert [b for b in mask_idx[row].tolist() if b >= 0] == want, (s, _j)
            row += 1
