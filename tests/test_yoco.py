"""YoCo prefill truncation (DESIGN section 10), single process.

Named hand-worked cases, exact comparison with the literal reference (tests/reference_yoco.py) on
random batches, view semantics (shared objects, nothing modified), the truncation's meaning (a
kept row sees exactly the untruncated keys at positions >= rect_lo), and compact + CP with every
rank computed in a loop (the multi-process version is tests/test_yoco_multirank.py).
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
from cpmeta.cp.zigzag import NO_SPARSE_RATIOS_FALLBACK, mirror_rows, prepare_cp_mirror, unmirror
from cpmeta.build.swa_pivots import swa_visibility_pivots
from cpmeta.build.yoco import YOCO_COMPACT_FIELDS, YOCO_CP_FIELDS, build_yoco_fields
from cpmeta.cp.yoco_views import CONSUMER_CLEARED_FIELDS, get_consumer_view
from reference_yoco import ref_consumer_rows, ref_yoco_cp, ref_yoco_fields
from strategies import prompt_cases, random_config, random_prompt_batch

I32 = torch.int32
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
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    for lower, want in ((0, [6, 2, 11, 2]), (6, [8, 0, 12, 1]), (9, [8, 0, 13, 0])):
        got = swa_visibility_pivots(t(6), t(1), t(5), t(lower), t(4), t(11), 4)
        assert got.tolist() == [want], lower


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
        MetadataConfig(yoco_keep_tokens=bad)


@pytest.mark.parametrize("bad", ["Mask", "full", None])
def test_config_validation_mode(bad: Any) -> None:
    with pytest.raises(ValueError, match="yoco_mode"):
        MetadataConfig(yoco_keep_tokens=4, yoco_mode=bad)


def test_build_rejects_mismatched_sequences() -> None:
    cfg, seqs = _cfg(6), [_seq(10, 2, 6)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    with pytest.raises(ValueError, match="seqs"):
        build_yoco_fields(md, seqs * 2, cfg)
    short = [_seq(10, 2, 6)]
    short[0].token_ids = short[0].token_ids[:7]  # fewer than seqlen_k = 8
    with pytest.raises(ValueError, match=r"seqs\[0\].token_ids"):
        build_yoco_fields(md, short, cfg)
    with pytest.raises(ValueError, match="is_prompt"):
        build_yoco_fields(md.replace(is_prompt=False), seqs, cfg)
    assert build_yoco_fields(md, seqs, _cfg(None)) == {}


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
@given(case=prompt_cases(whole_prompt=True), k=st.integers(1, 80), mode=st.sampled_from(["mask", "compact"]))
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
    cfg = random_config(rng)
    cfg = _with_yoco(cfg, k if k is not None else rng.choice([1, 3, 8, 20, 60]), mode)
    return cfg, random_prompt_batch(rng, cfg, whole_prompt=True)


@pytest.mark.parametrize("seed", range(8))
def test_consumer_view_shares_everything_else_and_modifies_nothing(seed: int) -> None:
    cfg, seqs = _case(seed, "compact")
    md = cpmeta.prepare_prompt(seqs, cfg).compute_attn_info(cfg)  # derived fields present
    snap = _snapshot(md)
    view = md.get_consumer_view()
    assert view is not md
    for name in CONSUMER_CLEARED_FIELDS:
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
        if name not in CONSUMER_REPLACED and name not in CONSUMER_CLEARED_FIELDS:
            assert getattr(view, name) is getattr(md, name), name
    view.compute_attn_info(cfg)
    md.get_consumer_view().compute_attn_info(cfg)
    _assert_unchanged(md, snap)
    # expanded compact rows = full expansion at the kept rows for the compressed KV
    rows = md.yoco_consumer_query_indices.long()
    for key, idx in md.kv_ca_index.items():
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


# ---- compact + CP, every rank in one process ------------------------------------------------


def _mirror_all(md: cpmeta.InputMetadata, p: int) -> list[cpmeta.InputMetadata]:
    return [cpmeta.prepare_for_mirror_cp(md, r, p) for r in range(p)]


def _check_redistribution(md: cpmeta.InputMetadata, parts: list[cpmeta.InputMetadata]) -> None:
    """all_gather(full_mirror_rows[contrib])[boundary] == compact mirror rows (non-pad rows)."""
    views = [part.get_consumer_view() for part in parts]
    full_rows = {  # per-row payloads in the full layout
        "row": torch.arange(md.total_q, dtype=I32), "positions": md.positions, "input_ids": md.input_ids,
    }
    for name, full in full_rows.items():
        contrib = []
        for part in parts:
            mine = mirror_rows(full, part.mirror_cp_index, 0)  # this rank's full-mirror rows
            contrib.append(mirror_rows(mine, part.yoco_cp_contrib_index, 0))
        gathered = torch.cat(contrib)
        compact = full[md.yoco_consumer_query_indices.long()]
        for part, view in zip(parts, views):
            want = mirror_rows(compact, view.mirror_cp_index, 0)
            got = mirror_rows(gathered, part.yoco_cp_boundary_index, 0)
            assert torch.equal(got, want), f"{name} rank {part.cp_rank}"
            assert torch.equal(part.yoco_cp_boundary_index < 0, view.mirror_cp_index < 0)


def _check_cp_case(cfg: MetadataConfig, seqs: list[SequenceMetadata], p: int) -> None:
    md = cpmeta.prepare_prompt(seqs, cfg)
    parts = _mirror_all(md, p)
    for r, part in enumerate(parts):
        ref = ref_yoco_cp(seqs, cfg, p, r)
        for name in YOCO_CP_FIELDS:
            assert _plain(getattr(part, name)) == ref[name], f"{name} rank {r}/{p}"
        view = part.get_consumer_view()
        for name in MIRRORED_VIEW_FIELDS:
            assert _plain(getattr(view, name)) == ref["view"][name], f"view.{name} rank {r}/{p}"
    _check_redistribution(md, parts)
    # expanded indices of the mirrored consumer views un-mirror to the non-CP consumer view's
    flat = md.get_consumer_view().compute_attn_info(cfg)
    views = [part.get_consumer_view().compute_attn_info(cfg) for part in parts]
    reverse = views[0].mirror_cp_reverse_index
    paths = [p_ for p_, _ in flat.tensors() if p_.split(".")[0] in ("kv_swa_full_index", "kv_ca_index",
                                                                      "kv_ca_index_len", "ks", "ke")]
    for path in paths:
        rows = [dict(v.tensors())[path] for v in views]
        assert torch.equal(unmirror(rows, reverse), dict(flat.tensors())[path]), path


def test_cp_hand_case_redistribution() -> None:
    """One sequence, q_len 10, clip 5 (module docstring of mirror_yoco), p = 2."""
    cfg, seqs = _cfg(5, max_model_len=64), [_seq(10, 0, 10)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    r0, r1 = _mirror_all(md, 2)
    assert r0.yoco_consumer_cp_contrib_pad_len == r1.yoco_consumer_cp_contrib_pad_len == 4
    assert r0.yoco_consumer_cp_mirror_len == 4
    assert r0.yoco_cp_contrib_index.tolist() == [3, -1, -1, -1]
    assert r1.yoco_cp_contrib_index.tolist() == [2, 3, 4, 5]
    assert r0.yoco_cp_boundary_index.tolist() == [4, 5, -1, -1]
    assert r1.yoco_cp_boundary_index.tolist() == [6, 7, 0, -1]
    v0 = r0.get_consumer_view()
    assert v0.positions.tolist() == [5, 6, 0, 0] and v0.valid_token_mask.tolist() == [True, True, False, False]
    assert v0.positions_cp is md.yoco_consumer_positions
    _check_cp_case(cfg, seqs, 2)


@pytest.mark.parametrize("seed", range(10))
def test_cp_random_batches_every_rank(seed: int) -> None:
    rng = random.Random(1000 + seed)
    cfg, seqs = _case(1000 + seed, "compact", k=rng.choice([1, 2, 5, 16, 64]))
    for p in (1, 2, 3, 4, 8):
        _check_cp_case(cfg, seqs, p)


def test_compact_mirror_needs_the_original_cu_seqlens_k() -> None:
    """prepare_cp_mirror on the compact rows with the ORIGINAL cu_seqlens_k gives the right
    positions/ks/ke; with the compact prefix sums as keys the rows would start at position 0."""
    cfg = _cfg(4, sparse_compress_ratios=(2,))
    seqs = [_seq(12, 4, 8), _seq(9, 0, 9, state=1)]  # clip 4 and 5: kept chunks start at 8 and 5
    md = cpmeta.prepare_prompt(seqs, cfg)
    p, cu_c, total_c = 2, md.yoco_consumer_cu_seqlens_q, md.yoco_consumer_total_q
    length = cpmeta.prepare_for_mirror_cp(md, 0, p).yoco_consumer_cp_mirror_len
    for r in range(p):
        view = cpmeta.prepare_for_mirror_cp(md, r, p).get_consumer_view()
        idx, _, ks, ke = prepare_cp_mirror(cu_c, cu_c, p, r, (2,), total_c, length)
        assert torch.equal(idx, view.mirror_cp_index)  # same rows ...
        wrong_pos = mirror_rows(torch.cat([torch.arange(int(n)) for n in cu_c.diff()]).to(I32), idx, 0)
        right = mirror_rows(md.yoco_consumer_positions, idx, 0)
        assert torch.equal(view.positions, right)
        assert not torch.equal(wrong_pos, right)  # ... but other positions
        assert not torch.equal(ke["2"], view.ke["2"]) or not torch.equal(ks["2"], view.ks["2"])


def test_cp_mask_mode_pivots_pass_through() -> None:
    cfg, seqs = _case(77, "mask", k=5)
    md = cpmeta.prepare_prompt(seqs, cfg)
    flat = md.get_mask_view().compute_attn_info(cfg).kv_swa_full_index
    for p in (2, 3):
        parts = _mirror_all(md, p)
        for part in parts:
            assert part.yoco_mask_swa_index_pivots is md.yoco_mask_swa_index_pivots
            assert all(getattr(part, f) is None for f in YOCO_CP_FIELDS)
        rows = [part.get_mask_view().compute_attn_info(cfg).kv_swa_full_index for part in parts]
        assert torch.equal(unmirror(rows, parts[0].mirror_cp_reverse_index), flat)


def test_no_sparse_ratios_consumer_mirror() -> None:
    """Without sparse ratios the compact mirror runs the (1,) fallback and the view keeps ks = {}."""
    cfg, seqs = _cfg(5, sparse_compress_ratios=()), [_seq(10, 0, 10), _seq(6, 2, 4, state=1)]
    assert NO_SPARSE_RATIOS_FALLBACK == (1,)
    md = cpmeta.prepare_prompt(seqs, cfg)
    assert md.yoco_consumer_ks == {} and md.yoco_consumer_ke == {}
    view = cpmeta.prepare_for_mirror_cp(md, 1, 2).get_consumer_view()
    assert view.ks == {} and view.ke == {}
    _check_cp_case(cfg, seqs, 2)


def test_mirrored_metadata_without_yoco_cp_fields_is_an_error() -> None:
    cfg, seqs = _cfg(5), [_seq(10, 0, 10)]
    part = cpmeta.prepare_for_mirror_cp(cpmeta.prepare_prompt(seqs, cfg), 0, 2)
    with pytest.raises(ValueError, match="yoco_consumer_cp_mirror_len"):
        part.replace(yoco_consumer_cp_mirror_len=None).get_consumer_view()


def test_placeholder_rows_are_invalid_in_the_mirrored_view() -> None:
    cfg = _cfg(3)
    seqs = [_seq(10, 2, 6), _seq(8, 0, 8, state=1, is_placeholder=True)]
    md = cpmeta.prepare_prompt(seqs, cfg)
    for r in range(2):
        view = cpmeta.prepare_for_mirror_cp(md, r, 2).get_consumer_view()
        ref = ref_yoco_cp(seqs, cfg, 2, r)["view"]
        assert view.valid_token_mask.tolist() == ref["valid_token_mask"]
        assert view.valid_token_mask[2:].tolist() == [False, False]  # sequence 1's two rows


# ---- CUDA: the views and the CP fields on GPU tensors equal the CPU ones ----------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_views_and_cp_fields_match_cpu(seed: int) -> None:
    from cpmeta.diff import metadata_diff

    for mode in ("compact", "mask"):
        cfg, seqs = _case(2000 + seed, mode)
        md = cpmeta.prepare_prompt(seqs, cfg)
        gpu = md.to("cuda")
        get_view = (lambda m: m.get_consumer_view()) if mode == "compact" else (lambda m: m.get_mask_view())
        for p in (1, 2, 4):
            for r in range(p):
                want = get_view(cpmeta.prepare_for_mirror_cp(md, r, p)).compute_attn_info(cfg)
                mirrored = cpmeta.prepare_for_mirror_cp(gpu, r, p)
                got = get_view(mirrored).compute_attn_info(cfg)
                for _path, t in got.tensors():
                    assert t.is_cuda, _path
                assert metadata_diff(want, got.to("cpu")) == [], (mode, p, r, metadata_diff(want, got.to("cpu")))
                assert metadata_diff(cpmeta.prepare_for_mirror_cp(md, r, p), mirrored.to("cpu")) == []
