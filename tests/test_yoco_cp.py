"""YoCo compact + CP (docs/design.md section 10) with every rank computed in one process, and the views
and CP fields on CUDA tensors. Split from tests/test_yoco.py (helpers shared through it); the
multi-process version is tests/test_yoco_multirank.py.
"""

from __future__ import annotations

import random

import pytest
import torch

import cpmeta
from cpmeta import MetadataConfig, SequenceMetadata
from cpmeta.cp.zigzag import NO_SPARSE_RATIOS_FALLBACK, mirror_rows, prepare_cp_mirror, unmirror
from cpmeta.builders.yoco import YOCO_CP_FIELDS
from reference_yoco import ref_yoco_cp

from test_yoco import I32, MIRRORED_VIEW_FIELDS, _case, _cfg, _plain, _seq

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
