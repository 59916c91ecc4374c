"""Quick sanity tests of the vectorized builders' own pieces (the exhaustive oracle comparison is
tests/test_builders.py): docstring worked examples, load-plan and expansion helpers, the fast
validation path, int32 overflow, out= refills, the CP-mirror gather in compute_attn_info, CUDA."""

from __future__ import annotations

import dataclasses

import random

import numpy as np
import pytest
import torch

from cpmeta import MetadataConfig, SequenceMetadata, prepare_decode, prepare_prompt
from cpmeta.builders.int_ops import loaded_compressed_len
from cpmeta.builders.attn_info import (
    compute_attn_info,
    expand_offset_len,
    expand_paged_offset_len,
    expand_swa_pivots,
    expand_swa_ring,
)
from cpmeta.sequence import blocks_needed, validate_batch

CUDA = torch.cuda.is_available()


def _seq(q: int, k: int, *, state: int = 0, table=None, cfg=None, prompt=True, **kw) -> SequenceMetadata:
    cfg = cfg or MetadataConfig.compressed_swa()
    table = list(range(10, 10 + blocks_needed(k, cfg))) if table is None else table
    toks = list(range(100, 100 + (k if prompt else k - q + 1)))
    drafts = [] if prompt else list(range(900, 900 + q - 1))
    return SequenceMetadata(seqlen_q=q, seqlen_k=k, block_table=table, state_id=state,
                            token_ids=toks, draft_tokens=drafts, **kw)


def test_loaded_compressed_len_one_helper_for_all_types() -> None:
    assert [loaded_compressed_len(k, 4) for k in (3, 8, 13)] == [1, 2, 3]
    assert loaded_compressed_len(np.array([3, 8, 13]), 4).tolist() == [1, 2, 3]
    assert loaded_compressed_len(torch.tensor([3, 8, 13]), 4).tolist() == [1, 2, 3]


def test_decode_docstring_example() -> None:
    cfg = MetadataConfig.compressed_swa()
    md = prepare_decode([_seq(2, 8, state=3, table=[5], prompt=False)], cfg)
    assert md.positions.tolist() == [6, 7] and md.context_lens.tolist() == [7, 8]
    assert md.input_ids.tolist() == [106, 900]
    assert md.klen["4"].tolist() == [1, 2]
    assert md.positions_c["4"].tolist() == [0, 4]
    assert md.slot_mapping_store_ca["4"].tolist() == [-1, 161]
    assert md.kv_swa_index_offset_len.tolist() == [[384, 7], [384, 8]]
    assert md.block_tables[:, 0].tolist() == [5, 5]
    assert md.block_tables.shape == (2, 16)  # the widest row (1) rounded up to 16, not max_num_blocks (64)
    assert md.kv_ca_index_offset_len["4"].tolist() == [[0, 1], [16 * 32, 2]]
    assert md.ks is None and md.load_segments_swa is None and md.ngram_token_ids is None


def test_prompt_docstring_example() -> None:
    cfg = MetadataConfig.compressed_swa(window_size=4, swa_block_size=4, block_size=8)
    md = prepare_prompt([_seq(3, 9, cfg=cfg)], cfg)
    assert md.positions.tolist() == [6, 7, 8]
    assert md.ks["4"].tolist() == [0, 0, 0] and md.ke["4"].tolist() == [1, 2, 2]
    assert md.positions_c["4"].tolist() == [4]
    assert md.kv_swa_full_index_pivots.tolist()[0] == [1, 3, 4, 1]
    assert md.kv_swa_full_index_pivots.tolist()[2] == [3, 1, 4, 3]
    assert md.total_k_swa == 4 and md.total_k_compressed == {"4": 2}
    assert md.context_lens is None and md.klen is None and md.block_tables is None


def test_swa_load_plan_examples() -> None:
    cfg = MetadataConfig.compressed_swa(window_size=8, swa_block_size=8, block_size=8)
    seqs = [_seq(1, 1, cfg=cfg), _seq(1, 12, state=2, cfg=cfg), _seq(1, 6, state=3, cfg=cfg)]
    segs = prepare_prompt(seqs, cfg).load_segments_swa.tolist()
    # seq 0: q_start 0 -> all 8 rows zero-filled; seq 1: q_start 11 -> ring wraps; seq 2: q_start 5
    assert segs == [[-1, 0, 8, 0], [2, 3, 8, 8], [2, 0, 3, 13], [-1, 0, 3, 16], [3, 0, 5, 19]]


def test_paged_load_plan_example() -> None:
    cfg = MetadataConfig.compressed_swa(block_size=128, dense_compress_ratios=(4,), sparse_compress_ratios=())
    seqs = [_seq(1, 3, table=[1]), _seq(1, 280, table=[9, 4, 6], state=1)]
    segs = prepare_prompt(seqs, cfg).load_segments_ca["4"].tolist()  # dst bases: cu_compressed_seqlens_k [0, 1]
    assert segs == [[-1, 0, 1, 0], [9, 0, 32, 1], [4, 0, 32, 33], [6, 0, 6, 65]]


def test_ngram_docstring_example() -> None:
    cfg = MetadataConfig.compressed_swa(max_ngram_size=3, image_token_id=77, ngram_pad_token=-5)
    s = SequenceMetadata(seqlen_q=4, seqlen_k=4, block_table=[0], state_id=0, token_ids=[5, 7, 77, 8])
    assert prepare_prompt([s], cfg).ngram_token_ids.tolist() == [
        [5, -5, -5], [7, 5, -5], [-5, -5, -5], [8, -5, -5]]


def test_expansion_helpers_examples() -> None:
    off, ln = torch.tensor([5], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert expand_offset_len(off, ln, 6).tolist() == [[5, 6, 7, -1, -1, -1]]
    piv = torch.tensor([[10, 2, 40, 3]], dtype=torch.int32)
    assert expand_swa_pivots(piv, 6).tolist() == [[10, 11, 40, 41, 42, -1]]
    ol = torch.tensor([[22, 4]], dtype=torch.int32)
    assert expand_swa_ring(ol, 6, 8).tolist() == [[22, 23, 16, 17, -1, -1]]
    bt = torch.tensor([[1, 2, 3, 4], [9, 4, 0, 0]], dtype=torch.int32)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    row = expand_paged_offset_len(i32(128), i32(40), 48, bt, 32)[0].tolist()
    assert row[:32] == list(range(288, 320)) and row[32:40] == list(range(128, 136))
    assert row[40:] == [-1] * 8


def test_paged_expansion_aligned_equals_generic() -> None:
    from cpmeta.builders.attn_info import _expand_paged_aligned, _expand_paged_generic

    g = torch.Generator().manual_seed(0)
    for tpb, mnb, width in ((32, 4, 128), (8, 3, 24), (256, 2, 384)):
        bt = torch.randint(0, 1000, (5, mnb), generator=g, dtype=torch.int32)
        off = torch.arange(5, dtype=torch.int32) * mnb * tpb
        ln = torch.randint(0, min(width, mnb * tpb) + 1, (5,), generator=g, dtype=torch.int32)
        a = _expand_paged_aligned(off, ln.clone(), width, bt, tpb)
        assert torch.equal(a, _expand_paged_generic(off, ln.clone(), width, bt, tpb)), tpb
        assert a.shape == (5, width) and a.is_contiguous()
    # an unaligned offset takes the generic path: p = 130 + k, tpb 32 -> block 4 (=7) at 2.., block 5 (=8)
    bt = torch.tensor([[0, 0, 0, 0, 7, 8]], dtype=torch.int32)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    row = expand_paged_offset_len(i32(130), i32(32), 40, bt, 32)[0].tolist()
    assert row[:30] == list(range(226, 256)) and row[30:32] == [256, 257] and row[32:] == [-1] * 8


BAD_CASES = {
    "seqlen_q_zero": dict(seqlen_q=0),
    "q_gt_k": dict(seqlen_q=9, seqlen_k=8),
    "too_long": dict(seqlen_k=10**6),
    "neg_state": dict(state_id=-1),
    "neg_svs": dict(swa_valid_start=-2),
    "float_q": dict(seqlen_q=1.0),
    "bool_state": dict(state_id=True),
    "short_table": dict(block_table=[]),
    "drafts_on_prompt": dict(draft_tokens=[1]),
    "few_tokens": dict(token_ids=[1]),
}


@pytest.mark.parametrize("name", sorted(BAD_CASES))
@pytest.mark.parametrize("prompt", [True, False])
def test_fast_validation_raises_the_validate_batch_error(name: str, prompt: bool) -> None:
    cfg = MetadataConfig.compressed_swa(max_model_len=1024)
    good = [_seq(1, 300, state=1, prompt=prompt), _seq(1, 200, state=2, prompt=prompt)]
    fields = {f: getattr(good[1], f) for f in SequenceMetadata.__slots__}
    fields.update(BAD_CASES[name])
    seqs = [good[0], SequenceMetadata(**fields)]
    with pytest.raises((ValueError, TypeError)) as expected:
        validate_batch(seqs, cfg, is_prompt=prompt)
    build = prepare_prompt if prompt else prepare_decode
    with pytest.raises(type(expected.value), match=r"^seqs\[1\]\.") as got:
        build(seqs, cfg)
    assert str(got.value) == str(expected.value)


def test_empty_batch_and_wrong_type() -> None:
    with pytest.raises(ValueError, match="seqs"):
        prepare_decode([], MetadataConfig.compressed_swa())
    with pytest.raises(TypeError, match=r"seqs\[0\]"):
        prepare_prompt([object()], MetadataConfig.compressed_swa())  # type: ignore[list-item]


def test_negative_block_id_named() -> None:
    with pytest.raises(ValueError, match=r"seqs\[1\]\.block_table"):
        prepare_decode([_seq(1, 5, prompt=False), _seq(1, 5, table=[-3], state=1, prompt=False)], MetadataConfig.compressed_swa())


def test_decode_offset_overflow_checked_before_allocation() -> None:
    cfg = MetadataConfig.compressed_swa(block_size=2048, dense_compress_ratios=(1,), sparse_compress_ratios=(),
                         max_model_len=131072)
    # max_num_blocks = 64, block_size // 1 = 2048 -> 131072 per row; 16384 rows reach 2**31
    seqs = [_seq(1, 2, state=i, cfg=cfg, prompt=False) for i in range(16384)]
    out: dict[str, torch.Tensor] = {}
    with pytest.raises(ValueError, match=r"kv_ca_index_offset_len.*total_q \(16384\).*max_num_blocks \(64"):
        prepare_decode(seqs, cfg, out=out)
    assert out == {}  # nothing was allocated
    prepare_decode(seqs[:16383], cfg)  # one row less fits


def test_prompt_slot_overflow() -> None:
    cfg = MetadataConfig.compressed_swa()
    with pytest.raises(ValueError, match="slot_mapping_store_swa.*overflow"):
        prepare_prompt([_seq(1, 5, state=2**24)], cfg)
    with pytest.raises(ValueError, match="slot_mapping_store_ca.*overflow"):
        prepare_prompt([_seq(1, 5, table=[2**27])], cfg)


def test_out_refills_same_tensors_and_rejects_mismatch() -> None:
    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(4, 128), max_ngram_size=2)
    rng = random.Random(1)
    mk = lambda: [_seq(3, rng.randint(3, 900), state=i, prompt=False) for i in range(5)]  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    md1 = prepare_decode(mk(), cfg, out=out)
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    assert "klen" in out and "kv_ca_index_offset_len" in out and "block_tables" in out
    assert out["kv_ca_index_offset_len"].shape == (2, 15, 2)  # stacked: [n_ratio, total_q, 2]
    seqs2 = mk()
    md2 = prepare_decode(seqs2, cfg, out=out)
    assert {k: v.data_ptr() for k, v in out.items()} == ptrs
    assert md2.positions is md1.positions
    assert md2.klen["4"].data_ptr() == out["klen"].data_ptr() and torch.equal(md2.klen["4"], out["klen"][0])
    fresh = prepare_decode(seqs2, cfg)
    assert torch.equal(md2.kv_ca_index_offset_len["128"], fresh.kv_ca_index_offset_len["128"])
    with pytest.raises(ValueError, match=r"^\w+: expected shape \(12,\), got \(15,\) in out"):
        prepare_decode(mk()[:4], cfg, out=out)  # the first [total_q] field checked is named
    for key in ("klen", "block_tables"):  # a value that is no tensor (was an AttributeError of .dtype / .dim)
        with pytest.raises(TypeError, match=rf"^out\['{key}'\]: expected a tensor, got str$"):
            prepare_decode(seqs2, cfg, out={**out, key: "x"})


def test_output_arenas_refill_one_arena_per_shape() -> None:
    """``out=OutputArenas()``: every call with a batch shape (rows, sequences, table width) refills
    that shape's arena (the same tensor objects, values equal to a fresh build); other shapes get
    their own arena; the oldest is dropped past ``max_shapes``."""
    from cpmeta import OutputArenas
    from cpmeta.diff import metadata_diff

    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(4, 128), max_ngram_size=2)
    rng = random.Random(2)
    mk = lambda n, q: [_seq(q, rng.randint(q, 900), state=i, prompt=False, table=list(range(8)))  # noqa: E731
                       for i in range(n)]
    arenas = OutputArenas(max_shapes=2)
    first = prepare_decode(mk(5, 3), cfg, out=arenas)
    for _ in range(3):
        seqs = mk(5, 3)
        md = prepare_decode(seqs, cfg, out=arenas)
        assert md.positions is first.positions and md.klen["4"] is first.klen["4"] and len(arenas) == 1
        assert metadata_diff(md, prepare_decode(seqs, cfg), cfg=cfg) == []
    other = prepare_decode(mk(4, 1), cfg, out=arenas)
    assert len(arenas) == 2 and other.positions.data_ptr() != first.positions.data_ptr()
    prepare_decode(mk(2, 1), cfg, out=arenas)  # a third shape: the first arena is dropped
    assert len(arenas) == 2 and prepare_decode(mk(5, 3), cfg, out=arenas).positions is not first.positions
    with pytest.raises(ValueError, match="max_shapes"):
        OutputArenas(max_shapes=0)


def test_prompt_arenas_refilled_while_only_lengths_change() -> None:
    """Chunks of a prefill advancing with the same shapes (rows, sequences, table width): every
    ``prepare_prompt(out=OutputArenas())`` refills ONE arena although ``max_seqlen_k`` (a value,
    not a shape) changes each call, and equals a fresh build."""
    from cpmeta import OutputArenas
    from cpmeta.diff import metadata_diff

    cfg = MetadataConfig()
    mk = lambda ks: [_seq(32, k, state=i, table=list(range(8)), cfg=cfg) for i, k in enumerate(ks)]  # noqa: E731
    arenas = OutputArenas()
    first = prepare_prompt(mk([64, 96]), cfg, out=arenas)
    for ks in ([96, 128], [128, 64], [32, 32]):
        seqs = mk(ks)
        md = prepare_prompt(seqs, cfg, out=arenas)
        assert md.positions is first.positions and len(arenas) == 1 and md.max_seqlen_k == max(ks)
        assert metadata_diff(md, prepare_prompt(seqs, cfg), cfg=cfg) == []


def test_caller_owned_output_buffers_protocol() -> None:
    """``out=`` any ``OutputBuffers``: ``prepare_decode`` asks it for the arena of the call's layout
    and writes there (here: a caller's own bytes, every tensor inside them, values equal to a
    fresh build); anything that is neither None, a dict nor an ``OutputBuffers`` is a TypeError,
    and ``prepare_prompt`` (shapes known only after its fill) refuses an arena."""
    from cpmeta import prepare_prompt
    from cpmeta.buffers import OutputBuffers
    from cpmeta.diff import metadata_diff
    from cpmeta.buffers import ArenaLayout, HostArena

    class OneArena(OutputBuffers):
        def __init__(self, nbytes: int) -> None:
            self.raw = torch.zeros(nbytes, dtype=torch.uint8)
            self.layouts: list[ArenaLayout] = []

        def arena(self, layout: ArenaLayout) -> HostArena:
            self.layouts.append(layout)
            return HostArena(layout, raw=self.raw)

    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(4, 128), max_ngram_size=2)
    rng = random.Random(3)
    seqs = [_seq(2, rng.randint(2, 900), state=i, prompt=False) for i in range(4)]
    mine = OneArena(1 << 16)
    md = prepare_decode(seqs, cfg, out=mine)
    lo, hi = mine.raw.data_ptr(), mine.raw.data_ptr() + mine.raw.numel()
    for path, t in md.tensors():
        assert lo <= t.data_ptr() < hi, path
    assert len(mine.layouts) == 1 and set(mine.layouts[0].fields) == {p.partition(".")[0] for p, _ in md.tensors()}
    assert metadata_diff(md, prepare_decode(seqs, cfg), cfg=cfg) == []
    with pytest.raises(ValueError, match="raw"):
        prepare_decode(seqs, cfg, out=OneArena(16))  # too small for the layout
    with pytest.raises(TypeError, match="OutputBuffers"):
        prepare_decode(seqs, cfg, out=[])  # type: ignore[arg-type]
    pseqs = [_seq(3, 9, state=0, prompt=True)]  # the prompt build writes into the caller's arena too
    pmd = prepare_prompt(pseqs, cfg, out=mine)
    for path, t in pmd.tensors():
        assert lo <= t.data_ptr() < hi, path
    assert metadata_diff(pmd, prepare_prompt(pseqs, cfg), cfg=cfg) == []
    with pytest.raises(TypeError, match="OutputBuffers"):
        prepare_prompt(pseqs, cfg, out=[])  # type: ignore[arg-type]


def test_decode_out_schema_is_stacked_on_both_paths() -> None:
    """One out= schema: per-ratio keys ("klen.4") are refused by the eager and in-place paths."""
    from cpmeta.gpu.decode_inplace import prepare_decode_inplace

    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(4, 128))
    seqs = [_seq(1, 40 + i, state=i, prompt=False) for i in range(3)]
    out: dict[str, torch.Tensor] = {"block_tables": torch.zeros(3, cfg.max_num_blocks, dtype=torch.int32)}
    prepare_decode(seqs, cfg, out=out)  # fixed shapes: the table at max_num_blocks columns
    inplace_out = {k: v.clone() for k, v in out.items()}  # the eager buffers serve the in-place path
    md = prepare_decode_inplace(seqs, cfg, out=inplace_out, device="cpu", backend="torch")
    assert md.klen["4"].data_ptr() == inplace_out["klen"].data_ptr()
    for fn in (prepare_decode, lambda s, c, out: prepare_decode_inplace(s, c, out=out, device="cpu", backend="torch")):
        with pytest.raises(ValueError, match=r"out\['klen\.4'\].*stacked under 'klen'"):
            fn(seqs, cfg, out={"klen.4": torch.zeros(3, dtype=torch.int32)})


def test_empty_ratio_sets_are_empty_dicts() -> None:
    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(), sparse_compress_ratios=(8,))
    p = prepare_prompt([_seq(5, 20, cfg=cfg)], cfg)
    assert p.kv_ca_index_offset_len == {} and set(p.ks) == {"8"}
    compute_attn_info(p, cfg)
    assert p.kv_ca_index == {} and p.kv_ca_index_len == {}
    cfg2 = MetadataConfig.compressed_swa(dense_compress_ratios=(8,), sparse_compress_ratios=())
    d = prepare_decode([_seq(1, 20, cfg=cfg2, prompt=False)], cfg2)
    assert d.klen == {} and set(d.kv_ca_index_offset_len) == {"8"}


def test_dtypes() -> None:
    cfg = MetadataConfig.compressed_swa(max_ngram_size=1)
    for md in (prepare_prompt([_seq(4, 40)], cfg), prepare_decode([_seq(2, 40, prompt=False)], cfg)):
        compute_attn_info(md, cfg)
        for path, t in md.tensors():
            want = torch.bool if path in ("gate_force_random", "valid_token_mask") else torch.int32
            assert t.dtype == want, path


def test_attn_info_idempotent_and_clean() -> None:
    cfg = MetadataConfig.compressed_swa()
    md = prepare_prompt([_seq(7, 300)], cfg)
    compute_attn_info(md, cfg)
    before = [id(md.kv_ca_index["4"]), id(md.kv_ca_index_len), id(md.kv_swa_full_index)]
    md.compute_attn_info(cfg)
    assert [id(md.kv_ca_index["4"]), id(md.kv_ca_index_len), id(md.kv_swa_full_index)] == before
    assert md.kv_ca_index["4"].shape == (7, cfg.attn_index_width(4))
    md.clean_derived_()
    assert md.kv_ca_index is None and md.kv_swa_full_index is None


def test_attn_info_mirror_gathers_full_rows() -> None:
    cfg = MetadataConfig.compressed_swa(window_size=8, swa_block_size=8, block_size=16)
    md = prepare_prompt([_seq(5, 40, cfg=cfg), _seq(3, 3, state=1, cfg=cfg)], cfg)
    full = compute_attn_info(md.replace(), cfg)
    mirror = torch.tensor([4, -1, 0, 6, -1], dtype=torch.int32)
    mm = compute_attn_info(md.replace(mirror_cp_index=mirror, cp_mirror_len=5), cfg)
    g = mirror.clamp(min=0).long()
    pad = (mirror < 0)[:, None]
    assert torch.equal(mm.kv_swa_full_index, full.kv_swa_full_index[g].masked_fill(pad, -1))
    assert torch.equal(mm.kv_ca_index["4"], full.kv_ca_index["4"][g].masked_fill(pad, -1))
    assert mm.kv_ca_index_len["4"].tolist() == [full.kv_ca_index_len["4"][4].item(), 0,
                                                full.kv_ca_index_len["4"][0].item(),
                                                full.kv_ca_index_len["4"][6].item(), 0]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("seed", range(5))
def test_attn_info_cuda_equals_cpu(seed: int) -> None:
    rng = random.Random(seed)
    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(4, 128), sparse_compress_ratios=(4,), max_model_len=4096)
    pro = [_seq(rng.randint(1, 300), rng.randint(300, 4000), state=i) for i in range(4)]
    dec = [_seq(1 + rng.randint(0, 2), rng.randint(3, 4000), state=i, prompt=False) for i in range(9)]
    for md in (prepare_prompt(pro, cfg), prepare_decode(dec, cfg)):
        gpu = compute_attn_info(md.to("cuda"), cfg)
        cpu = compute_attn_info(md, cfg)
        for name in ("kv_ca_index", "kv_ca_index_len"):
            for k, v in getattr(cpu, name).items():
                assert torch.equal(getattr(gpu, name)[k].cpu(), v), (name, k)
        for name in ("kv_swa_full_index", "kv_swa_index"):
            if getattr(cpu, name) is not None:
                assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


def _as_lists(v):  # tensors -> nested lists, dicts kept
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _as_lists(x) for k, x in v.items()}
    return v


@pytest.mark.parametrize("seed", range(12))
def test_non_power_of_two_sizes_match_reference(seed: int) -> None:
    """The builders use shifts/masks for power-of-two divisors; cover the divide path too."""
    from reference import ALL_REF_FIELDS, ref_compute_attn_info, ref_prepare_decode, ref_prepare_prompt
    from strategies import random_config, random_decode_batch, random_prompt_batch

    rng = random.Random(seed)
    bs = rng.choice([12, 24, 60])
    divs = [d for d in range(1, bs + 1) if bs % d == 0]
    cfg = random_config(rng, block_size=bs, dense_compress_ratios=tuple(sorted(set(rng.sample(divs, 2)))),
                        sparse_compress_ratios=(rng.choice(divs),), window_size=rng.choice([5, 30]),
                        swa_block_size=37)
    for prompt in (True, False):
        seqs = (random_prompt_batch if prompt else random_decode_batch)(rng, cfg)
        md = compute_attn_info((prepare_prompt if prompt else prepare_decode)(seqs, cfg), cfg)
        ref = ref_compute_attn_info((ref_prepare_prompt if prompt else ref_prepare_decode)(seqs, cfg), cfg)
        for name in ALL_REF_FIELDS:
            got = _as_lists(getattr(md, name))
            if name == "block_tables" and got is not None:
                got = [row[: len(e)] for row, e in zip(got, ref[name])]
            assert got == ref[name], name


def test_decode_block_tables_carry_the_whole_table() -> None:
    """Columns past the compressed need hold the rest of the sequence's table (a full-attention KV
    cache reads them through the slot mapping), cut to max_num_blocks; -1 after the table."""
    cfg = MetadataConfig.compressed_swa(max_model_len=1024)  # max_num_blocks = 8
    seqs = [_seq(1, 130, state=0, prompt=False), _seq(2, 300, state=1, prompt=False)]
    seqs[0] = dataclasses.replace(seqs[0], block_table=list(range(10, 20)))  # 10 blocks > 8 columns
    seqs[1] = dataclasses.replace(seqs[1], block_table=[5, 6, 7])
    md = prepare_decode(seqs, cfg)
    assert md.block_tables.tolist() == [list(range(10, 18)), [5, 6, 7] + [-1] * 5, [5, 6, 7] + [-1] * 5]



def test_decode_block_tables_are_as_wide_as_the_batch() -> None:
    """``block_tables`` has the batch's widest row's columns (the longest table) rounded up to 16,
    not ``max_num_blocks``; a caller's fixed width (``table_width=`` or ``out["block_tables"]``)
    may be anything from the widest row to ``max_num_blocks``, and the offsets of
    ``kv_ca_index_offset_len`` follow it; a narrower or wider one is refused naming it. The
    expansion reads the same slots at every width."""
    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(4, 128))  # max_num_blocks 64
    tables = [list(range(10, 27)), [5, 6, 7]]  # the widest row: 17 blocks
    seqs = [_seq(1, 130, state=0, prompt=False, table=tables[0]), _seq(2, 300, state=1, prompt=False, table=tables[1])]
    md = prepare_decode(seqs, cfg).compute_attn_info(cfg)
    assert md.block_tables.tolist() == [t + [-1] * (32 - len(t)) for t in (tables[0], tables[1], tables[1])]
    assert md.kv_ca_index_offset_len["4"][:, 0].tolist() == [0, 32 * 32, 2 * 32 * 32]
    few = prepare_decode(seqs[1:], cfg)
    assert few.block_tables.shape == (2, 16)
    for cols in (17, 20, 64):
        for fixed in (prepare_decode(seqs, cfg, out={"block_tables": torch.zeros(3, cols, dtype=torch.int32)}),
                      prepare_decode(seqs, cfg, table_width=cols)):
            assert fixed.block_tables.shape == (3, cols)
            assert fixed.block_tables[:, :17].tolist() == md.block_tables[:, :17].tolist()
            assert fixed.block_tables[:, 17:].eq(-1).all()
            assert fixed.kv_ca_index_offset_len["4"][:, 0].tolist() == [0, cols * 32, 2 * cols * 32]
            fixed.compute_attn_info(cfg)
            for n in ("4", "128"):
                assert torch.equal(fixed.kv_ca_index[n], md.kv_ca_index[n])
    for cols in (16, 65):
        with pytest.raises(ValueError, match=r"out\['block_tables'\].*widest row \(17 blocks\).*max_num_blocks \(64\)"):
            prepare_decode(seqs, cfg, out={"block_tables": torch.zeros(3, cols, dtype=torch.int32)})
        with pytest.raises(ValueError, match=rf"table_width: .*widest row \(17 blocks\).*max_num_blocks \(64\), got {cols}"):
            prepare_decode(seqs, cfg, table_width=cols)
