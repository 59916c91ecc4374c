"""Builders vs the per-token reference, exactly (docs/design.md sections 4 and 5).

- named hand-checked cases (``builder_cases.py``): the hand values are asserted on the reference
  AND on the builder; then every field of the builder equals the reference;
- hypothesis random batches (``strategies.py``) on both paths, before and after
  ``compute_attn_info``;
- the ``out=`` path, idempotence of ``compute_attn_info``, ``get_clean_list``, int32 overflow,
  dtypes, and that the builders validate their input.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import cpmeta
from builder_cases import NAMED_CASES, NamedCase
from cpmeta.config import MetadataConfig
from cpmeta.metadata import InputMetadata
from cpmeta.sequence import SequenceMetadata
from reference import (
    ALL_REF_FIELDS,
    DERIVED,
    ref_compute_attn_info,
    ref_prepare_decode,
    ref_prepare_prompt,
)
from strategies import decode_cases, prompt_cases, random_decode_batch, random_prompt_batch

BOOL_FIELDS = frozenset({"gate_force_random", "valid_token_mask"})
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_PATH = re.compile(r"^(\w+)(?:\.(\w+))?(?:\[(\d+)\])?$")


# ---- helpers --------------------------------------------------------------------------------


def _ref(seqs: list[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> dict[str, Any]:
    return (ref_prepare_prompt if is_prompt else ref_prepare_decode)(seqs, cfg)


def _build(seqs: list[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool, **kw: Any) -> InputMetadata:
    fn: Callable[..., InputMetadata] = cpmeta.prepare_prompt if is_prompt else cpmeta.prepare_decode
    return fn(seqs, cfg, **kw)


def _get(d: dict[str, Any], path: str) -> Any:
    m = _PATH.match(path)
    assert m, path
    name, key, row = m.groups()
    v = d[name]
    if key is not None:
        v = v[key]
    if row is not None:
        v = v[int(row)]
    return v


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def md_to_plain(md: InputMetadata, ref: dict[str, Any]) -> dict[str, Any]:
    """The builder's fields as python values; ``block_tables`` rows cut to the defined prefix."""
    out = {name: _plain(getattr(md, name)) for name in ALL_REF_FIELDS}
    if ref["block_tables"] is not None and out["block_tables"] is not None:
        out["block_tables"] = [row[: len(r)] for row, r in zip(out["block_tables"], ref["block_tables"])]
    return out


def _check_value(path: str, got: Any, exp: Any) -> None:
    field = path.split(".")[0]
    if isinstance(exp, list):
        assert isinstance(got, torch.Tensor), f"{path}: expected a tensor, got {type(got).__name__}"
        want = torch.bool if field in BOOL_FIELDS else torch.int32
        assert got.dtype == want, f"{path}: dtype {got.dtype}, expected {want}"
        assert got.tolist() == exp, f"{path}: builder differs from reference"
    else:
        assert not isinstance(got, torch.Tensor), f"{path}: expected a python scalar, got a tensor"
        assert type(got) is type(exp) and got == exp, f"{path}: got {got!r}, expected {exp!r}"


def assert_matches_reference(md: InputMetadata, ref: dict[str, Any], cfg: MetadataConfig) -> None:
    """Every field of sections 4/5 equals the reference (dtypes and dict keys included); decode
    ``block_tables`` has the reference's ``table_width`` columns."""
    for name in ALL_REF_FIELDS:
        got, exp = getattr(md, name), ref[name]
        if exp is None:
            assert got is None, f"{name}: expected None on this path, got {type(got).__name__}"
        elif name == "block_tables":
            assert got.dtype == torch.int32, f"block_tables: dtype {got.dtype}"
            assert tuple(got.shape) == (len(exp), ref["table_width"]), f"block_tables: shape {tuple(got.shape)}"
            for i, row in enumerate(exp):
                assert got[i, : len(row)].tolist() == row, f"block_tables[{i}]: defined columns differ"
        elif isinstance(exp, dict):
            assert isinstance(got, dict), f"{name}: expected a dict, got {type(got).__name__}"
            assert sorted(got) == sorted(exp), f"{name}: keys {sorted(got)}, expected {sorted(exp)}"
            for k in exp:
                _check_value(f"{name}.{k}", got[k], exp[k])
        else:
            _check_value(name, got, exp)
    if cfg.yoco_keep_tokens is None:
        for name in InputMetadata.field_names():
            if name not in ALL_REF_FIELDS:
                assert getattr(md, name) is None, f"{name}: expected None (no CP mirror, no YoCo)"


def _build_and_compare(seqs: list[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> InputMetadata:
    ref = _ref(seqs, cfg, is_prompt)
    md = _build(seqs, cfg, is_prompt)
    assert_matches_reference(md, ref, cfg)
    assert md.compute_attn_info(cfg) is md
    assert_matches_reference(md, ref_compute_attn_info(ref, cfg), cfg)
    return md


# ---- named cases ----------------------------------------------------------------------------

_IDS = [c.name for c in NAMED_CASES]


@pytest.mark.parametrize("case", NAMED_CASES, ids=_IDS)
def test_reference_hand_values(case: NamedCase) -> None:
    ref = ref_compute_attn_info(_ref(case.seqs, case.cfg, case.is_prompt), case.cfg)
    for path, exp in case.checks.items():
        assert _get(ref, path) == exp, path


@pytest.mark.parametrize("case", NAMED_CASES, ids=_IDS)
def test_builder_named_case(case: NamedCase) -> None:
    md = _build_and_compare(case.seqs, case.cfg, case.is_prompt)
    plain = md_to_plain(md, _ref(case.seqs, case.cfg, case.is_prompt))
    for path, exp in case.checks.items():
        assert _get(plain, path) == exp, path


def test_named_cases_cover_the_brief() -> None:
    names = set(_IDS)
    for must in ("first_chunk", "chunk_qstart_lt_W", "chunk_qstart_gt_W", "seqlen_k_lt_r", "ring_wrap",
                 "swa_valid_start", "placeholder_prompt", "mtp_drafts", "engram_image_prompt",
                 "dense1_sparse_none_prompt", "dense_4_128_sparse_4_prompt", "dense_4_sparse_none_prompt",
                 "dense_none_sparse_4_prompt", "plain_prompt", "plain_decode", "plain_kv_sharded_decode",
                 "compressed_no_swa_prompt", "swa_no_compressed_prompt"):
        assert must in names


# ---- random batches -------------------------------------------------------------------------


@SETTINGS
@given(case=prompt_cases())
def test_prompt_random(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    cfg, seqs = case
    _build_and_compare(seqs, cfg, True)


@SETTINGS
@given(case=decode_cases())
def test_decode_random(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    cfg, seqs = case
    _build_and_compare(seqs, cfg, False)


# ---- out= path ------------------------------------------------------------------------------


def _same_shape_batch(rng: random.Random, seqs: list[SequenceMetadata]) -> list[SequenceMetadata]:
    """Same lengths (so every shape matches), new tokens, states and block ids."""
    out = []
    for i, s in enumerate(seqs):
        out.append(dataclasses.replace(
            s,
            state_id=s.state_id + 1000 + i,
            block_table=[b + 7 for b in s.block_table],
            token_ids=[(t + 3) % 97 for t in s.token_ids],
            draft_tokens=[(t + 5) % 97 for t in s.draft_tokens],
            is_placeholder=not s.is_placeholder,
        ))
    return out


@pytest.mark.parametrize("is_prompt", [True, False], ids=["prompt", "decode"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_out_dict_refilled_in_place(is_prompt: bool, seed: int) -> None:
    from strategies import random_config

    rng = random.Random(seed)
    cfg = random_config(rng, max_ngram_size=2)
    gen = random_prompt_batch if is_prompt else random_decode_batch
    seqs1 = gen(rng, cfg)
    seqs2 = _same_shape_batch(rng, seqs1)
    out: dict[str, torch.Tensor] = {}
    md1 = _build(seqs1, cfg, is_prompt, out=out)
    assert_matches_reference(md1, _ref(seqs1, cfg, is_prompt), cfg)
    assert out, "out: the builder stored nothing in the dict it was given"
    ptrs = {path: t.data_ptr() for path, t in md1.tensors()}
    out_ptrs = {k: v.data_ptr() for k, v in out.items() if isinstance(v, torch.Tensor)}
    md2 = _build(seqs2, cfg, is_prompt, out=out)
    assert_matches_reference(md2, _ref(seqs2, cfg, is_prompt), cfg)
    assert {path: t.data_ptr() for path, t in md2.tensors()} == ptrs
    assert {k: v.data_ptr() for k, v in out.items() if isinstance(v, torch.Tensor)} == out_ptrs


@pytest.mark.parametrize("is_prompt", [True, False], ids=["prompt", "decode"])
def test_out_dict_mismatch_is_a_clear_error(is_prompt: bool) -> None:
    case = next(c for c in NAMED_CASES if c.is_prompt == is_prompt and c.name.startswith(("first", "mtp")))
    out: dict[str, torch.Tensor] = {}
    _build(case.seqs, case.cfg, is_prompt, out=out)
    key = next(k for k, v in out.items() if isinstance(v, torch.Tensor) and v.dtype == torch.int32)
    bad = dict(out)
    bad[key] = torch.zeros(out[key].shape, dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape(key)):
        _build(case.seqs, case.cfg, is_prompt, out=bad)
    bad[key] = torch.zeros((out[key].numel() + 3,), dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(key)):
        _build(case.seqs, case.cfg, is_prompt, out=bad)


# ---- compute_attn_info: idempotence, only-None, clean list ------------------------------------


def _derived_objects(md: InputMetadata) -> dict[str, Any]:
    objs: dict[str, Any] = {}
    for name in DERIVED:
        v = getattr(md, name)
        objs[name] = v
        if isinstance(v, dict):
            for k, x in v.items():
                objs[f"{name}.{k}"] = x
    return objs


@pytest.mark.parametrize("case", [c for c in NAMED_CASES if c.name in
                                  ("ring_wrap", "mtp_drafts", "dense_4_128_sparse_4_prompt",
                                   "dense_4_128_sparse_4_decode")], ids=lambda c: c.name)
def test_compute_attn_info_idempotent_and_clean_list(case: NamedCase) -> None:
    cfg = case.cfg
    md = _build(case.seqs, cfg, case.is_prompt)
    md.compute_attn_info(cfg)
    first = _derived_objects(md)
    md.compute_attn_info(cfg)
    second = _derived_objects(md)
    assert first.keys() == second.keys()
    for path, obj in first.items():
        assert second[path] is obj, f"{path}: second compute_attn_info re-created it"
    clean = md.get_clean_list()
    assert {"kv_ca_index_len", "kv_swa_index", "kv_ca_index", "kv_swa_full_index"} <= set(clean)
    for name in clean:
        setattr(md, name, None)
    md.compute_attn_info(cfg)
    expected = ref_compute_attn_info(_ref(case.seqs, cfg, case.is_prompt), cfg)
    assert_matches_reference(md, expected, cfg)
    for path, obj in _derived_objects(md).items():
        if isinstance(obj, torch.Tensor):
            assert obj is not first[path], f"{path}: not recomputed after the clean list reset it"


def test_compute_attn_info_fills_only_none_fields() -> None:
    case = next(c for c in NAMED_CASES if c.name == "first_chunk")
    md = _build(case.seqs, case.cfg, True)
    sentinel = torch.full((10, 4), 77, dtype=torch.int32)
    md.kv_swa_full_index = sentinel
    md.compute_attn_info(case.cfg)
    assert md.kv_swa_full_index is sentinel
    assert md.kv_ca_index is not None and md.kv_ca_index_len is not None


def test_compute_attn_info_names_a_field_of_another_shape_or_config() -> None:
    """Shapes, dtypes and the config's ratios / window, read without a device sync (torch's own
    errors named no field: "too many indices", an index out of bounds for another block size)."""
    case = next(c for c in NAMED_CASES if c.name == "first_chunk")
    cfg = case.cfg
    md = _build(case.seqs, cfg, True)
    piv, ol = md.kv_swa_full_index_pivots, md.kv_ca_index_offset_len
    assert piv is not None and ol
    k = next(iter(ol))
    piv_name, ol_name = "md.kv_swa_full_index_pivots", rf"md.kv_ca_index_offset_len\['{k}'\]"
    for changes, match in (
            ({"kv_swa_full_index_pivots": piv[:, :3]}, rf"{piv_name}: expected an integer tensor \[rows, 4\]"),
            ({"kv_swa_full_index_pivots": piv.bool()}, rf"{piv_name}: expected an integer tensor"),
            ({"kv_ca_index_offset_len": {k: ol[k].reshape(-1)}}, rf"{ol_name}: expected an integer tensor"),
            ({"kv_ca_index_offset_len": {"3": ol[k]}}, r"md.kv_ca_index_offset_len\['3'\]: not a compressed ratio")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(md, **changes).compute_attn_info(cfg)
    with pytest.raises(ValueError, match=rf"{piv_name}: sliding-window metadata, but cfg.window_size is 0"):
        dataclasses.replace(md, kv_ca_index_offset_len=None).compute_attn_info(MetadataConfig())


def test_compute_attn_info_names_decode_metadata_of_a_larger_block_size() -> None:
    """Decode metadata built with a block size twice the config's (same ratios) read past
    ``block_tables`` in torch's indexing (CPU: an index error naming no field; CUDA: a device
    assert). On CPU a ``ValueError`` names the field; the config it was built with still expands it."""
    case = next(c for c in NAMED_CASES if not c.is_prompt and c.cfg.ca_ratios and len(c.seqs) > 1)
    md = _build(case.seqs, case.cfg, False)
    half = dataclasses.replace(case.cfg, block_size=case.cfg.block_size // 2)
    with pytest.raises(ValueError, match=r"md.kv_ca_index_offset_len\['\d+'\]: keys reach entry \d+ of "
                                         r"md.block_tables' \d+ .*another block_size"):
        dataclasses.replace(md).compute_attn_info(half)
    assert dataclasses.replace(md).compute_attn_info(case.cfg).kv_ca_index is not None


# ---- validation and int32 overflow ------------------------------------------------------------


def test_builders_validate_input() -> None:
    cfg = MetadataConfig.compressed_swa(block_size=16, window_size=4, swa_block_size=4, max_model_len=64)
    good = SequenceMetadata(2, 5, [1], 0, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=re.escape("seqs[1].draft_tokens")):
        cpmeta.prepare_prompt([good, dataclasses.replace(good, draft_tokens=[9])], cfg)
    with pytest.raises(ValueError, match=re.escape("seqs[1].token_ids")):
        cpmeta.prepare_decode([SequenceMetadata(1, 5, [1], 0, [1, 2, 3, 4, 5]), good], cfg)
    with pytest.raises(ValueError, match=r"seqs"):
        cpmeta.prepare_decode([], cfg)


_OVERFLOW_MSG = re.compile(r"int32|overflow|2\*\*31", re.I)


def _decode_rows(total_q: int, per_seq: int = 8) -> list[SequenceMetadata]:
    seqs, left = [], total_q
    while left:
        q = min(per_seq, left)
        seqs.append(SequenceMetadata(q, q, [len(seqs)], len(seqs), [1], draft_tokens=[2] * (q - 1)))
        left -= q
    return seqs


def test_decode_kv_ca_offset_overflow_bound() -> None:
    # dense ratio 1, block 4096, max_model_len 2**20: max_num_blocks 256, the bound (docs/design.md
    # section 3) is total_q * 256 * 4096 = total_q * 2**20 <= 2**31 - 1: at most 2047 rows, whatever
    # the batch's table width. Each table here holds 1 block (width 16), so the offsets advance by
    # 16 * 4096 a row; a caller's full-width block_tables (out=, 256 columns) makes them reach the bound.
    cfg = MetadataConfig(block_size=4096, window_size=4, swa_block_size=4, dense_compress_ratios=(1,),
                         sparse_compress_ratios=(), max_model_len=2**20)
    with pytest.raises(ValueError, match=_OVERFLOW_MSG) as err:
        cpmeta.prepare_decode(_decode_rows(2048), cfg)
    assert re.search(r"max_model_len|dense_compress_ratios|block_size", str(err.value))
    seqs = _decode_rows(2047)
    md = cpmeta.prepare_decode(seqs, cfg)
    assert md.block_tables.shape == (2047, 16)
    assert md.kv_ca_index_offset_len["1"][-1].tolist() == [2046 * 16 * 4096, 7]  # last row: pos 6 of a 7-row seq
    md = cpmeta.prepare_decode(seqs, cfg, out={"block_tables": torch.zeros(2047, 256, dtype=torch.int32)})
    assert md.kv_ca_index_offset_len["1"][-1].tolist() == [2046 * 2**20, 7]


@pytest.mark.parametrize("is_prompt", [True, False], ids=["prompt", "decode"])
def test_slot_overflow(is_prompt: bool) -> None:
    # SWA slot state_id * S + pos % S: state 2**24 with S = 128 reaches 2**31 at pos 0.
    cfg = MetadataConfig.compressed_swa(block_size=128, window_size=128, swa_block_size=128, max_model_len=1024)
    seq = SequenceMetadata(1, 1, [0], 2**24, [1])
    with pytest.raises(ValueError, match=_OVERFLOW_MSG):
        _build([seq], cfg, is_prompt)
    ok = dataclasses.replace(seq, state_id=2**24 - 1)
    assert _build([ok], cfg, is_prompt).slot_mapping_store_swa.tolist() == [(2**24 - 1) * 128]
    # compressed slot block * b_c + c % b_c: block 2**26 with b_c = 32 reaches 2**31 at c = 0.
    if is_prompt:
        seq = SequenceMetadata(4, 4, [2**26], 0, [1, 2, 3, 4])
    else:
        seq = SequenceMetadata(4, 4, [2**26], 0, [1], draft_tokens=[5, 6, 7])
    with pytest.raises(ValueError, match=_OVERFLOW_MSG):
        _build([seq], cfg, is_prompt)


@pytest.mark.parametrize("build", ["prompt", "prompt_cp"])
def test_prompt_engram_errors_name_the_sequence_not_the_row(build: str) -> None:
    """Prompts of 3 rows each: the look-back's errors name the sequence whose row read the id
    (seqs[1]: rows 3..5), from the whole-batch build and from one CP rank's rows alike."""
    from cpmeta.cp import prepare_prompt_cp

    eng = MetadataConfig.compressed_swa(max_ngram_size=3, ngram_lookup=torch.tensor([5, 6, 2**31]))
    run = (lambda b: cpmeta.prepare_prompt(b, eng)) if build == "prompt" else \
        (lambda b: prepare_prompt_cp(b, eng, 0, 1))
    good = SequenceMetadata(3, 3, [1], 0, [0, 1, 1])
    assert run([good]).ngram_token_ids.tolist()[:3] == [[5, 0, 0], [6, 5, 0], [6, 6, 5]]  # CP: then a pad row
    with pytest.raises(ValueError, match=re.escape("ngram_token_ids: an id of seqs[1] does not fit in int32")):
        run([good, SequenceMetadata(3, 3, [2], 1, [0, 1, 2])])
    with pytest.raises(ValueError, match=re.escape("ngram_lookup: a token id of seqs[1] read by ngram_token_ids is "
                                                   "outside the table (3 entries)")):
        run([good, SequenceMetadata(3, 3, [2], 1, [0, 7, 1])])


def _decode_one(k: int, table: list[int], state: int, tokens: list[int]) -> SequenceMetadata:
    return SequenceMetadata(1, k, table, state, tokens)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_an_ngram_table_edited_in_place_is_read_as_it_is_now(dtype: torch.dtype) -> None:
    """The kernels' int64 copy of ``ngram_lookup`` is made once per table (no vocabulary-sized
    copy a step), and again after an in-place edit: both builders read the edited table."""
    from cpmeta.builders.common_njit import ngram_table

    table = torch.tensor([5, 6, 7, 8], dtype=dtype)
    cfg = MetadataConfig.compressed_swa(max_ngram_size=3, ngram_lookup=table)
    dec, pre = [_decode_one(5, [1], 0, [0, 1, 2, 3, 1])], [SequenceMetadata(5, 5, [1], 0, [0, 1, 2, 3, 1])]
    first = ngram_table(cfg)
    assert ngram_table(cfg) is first  # unchanged table: the same array, nothing converted
    assert cpmeta.prepare_decode(dec, cfg).ngram_token_ids.tolist() == [[6, 8, 7]]
    table[1] = 60
    table[3] = 80
    assert ngram_table(cfg).tolist() == [5, 60, 7, 80]
    for seqs, prompt in ((dec, False), (pre, True)):
        md = (cpmeta.prepare_prompt if prompt else cpmeta.prepare_decode)(seqs, cfg)
        assert_matches_reference(md, _ref(seqs, cfg, prompt), cfg)
    assert cpmeta.prepare_decode(dec, cfg).ngram_token_ids.tolist() == [[60, 80, 7]]


def test_decode_kernel_errors_name_the_field_and_write_nothing() -> None:
    """The decode kernel's checks (decode_njit / common_njit error codes) raise the named errors,
    and a refused batch leaves a reused arena as the last good build left it."""
    import numpy as np

    from cpmeta.state.batch import SequenceBatch

    cfg = MetadataConfig.compressed_swa()
    good = [_decode_one(40, [1], 0, list(range(40))), _decode_one(40, [2], 1, list(range(40)))]
    arenas = cpmeta.OutputArenas()
    md = cpmeta.prepare_decode(good, cfg, out=arenas)
    before = {p: t.clone() for p, t in md.tensors()}
    bad = [good[0], _decode_one(40, [-3], 1, list(range(40)))]
    with pytest.raises(ValueError, match=re.escape("seqs[1].block_table: expected block ids >= 0, got -3 at index 0")):
        cpmeta.prepare_decode(bad, cfg, out=arenas)
    assert all(torch.equal(t, before[p]) for p, t in md.tensors())  # same arena, untouched
    # Engram: a table read out of range anywhere wins over an id outside int32 in an earlier row
    eng = MetadataConfig.compressed_swa(max_ngram_size=3, ngram_lookup=torch.tensor([5, 6, 2**31]))
    wide = _decode_one(5, [1], 0, [0, 1, 2, 0, 1])  # row pos 4 looks back at token 2 -> 2**31
    with pytest.raises(ValueError, match=re.escape("ngram_token_ids: an id of seqs[1] does not fit in int32 (an "
                                                   "ngram_lookup entry or a compressed token id)")):
        cpmeta.prepare_decode([_decode_one(5, [1], 1, [0, 1, 1, 0, 1]), wide], eng)
    with pytest.raises(ValueError, match=re.escape("ngram_lookup: a token id of seqs[1] read by ngram_token_ids is "
                                                   "outside the table (3 entries)")):
        cpmeta.prepare_decode([wide, _decode_one(5, [1], 1, [0, 1, 7, 0, 1])], eng)
    assert cpmeta.prepare_decode([_decode_one(5, [1], 0, [0, 1, 1, 0, 1])], eng).ngram_token_ids.tolist() == [[6, 5, 6]]
    # sum(seqlen_k) past int32: three sequences of 2**30 keys (array input: one window id each)
    plain = MetadataConfig(block_size=2**20, max_model_len=2**30)
    k, need = 2**30, plain.max_num_blocks
    i64 = lambda *a: np.array(a, np.int64)  # noqa: E731
    sb = SequenceBatch(is_prompt=False, seqlen_q=i64(1, 1, 1), seqlen_k=i64(k, k, k), state_id=i64(0, 1, 2),
                       swa_valid_start=i64(0, 0, 0), is_placeholder=np.zeros(3, bool), num_tokens=i64(k, k, k),
                       block_tables=np.arange(3 * need, dtype=np.int64) % 2048,
                       block_table_offsets=i64(0, need, 2 * need, 3 * need), tokens=i64(7, 8, 9),
                       token_offsets=i64(0, 1, 2, 3), compressed=np.zeros(0, np.int64),
                       compressed_offsets=i64(0, 0, 0, 0), lookback=0)
    with pytest.raises(ValueError, match=re.escape(f"cu_seqlens_k: int32 overflow, sum(seqlen_k) = {3 * k} > 2**31 - 1")):
        cpmeta.prepare_decode(sb, plain)


def test_prompt_swa_buffer_overflow() -> None:
    # pivots P2 = n_seq * W + cu_seqlens_q[s] + k_lo: W = 2**28 with 8 sequences reaches 2**31.
    cfg = MetadataConfig.compressed_swa(block_size=128, window_size=2**28, swa_block_size=2**28, max_model_len=1024)
    seqs = [SequenceMetadata(1, 1, [0], i, [1]) for i in range(8)]
    with pytest.raises(ValueError, match=_OVERFLOW_MSG):
        cpmeta.prepare_prompt(seqs, cfg)
    md = cpmeta.prepare_prompt(seqs[:7], cfg)
    assert md.kv_swa_full_index_pivots[-1].tolist() == ref_prepare_prompt(seqs[:7], cfg)["kv_swa_full_index_pivots"][-1]


# ---- compute_attn_info on the tensors' device -----------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(6))
def test_compute_attn_info_on_cuda_matches_reference(seed: int) -> None:
    from strategies import random_config

    rng = random.Random(seed)
    cfg = random_config(rng)
    for is_prompt in (True, False):
        seqs = (random_prompt_batch if is_prompt else random_decode_batch)(rng, cfg)
        md = _build(seqs, cfg, is_prompt).to("cuda")
        md.compute_attn_info(cfg)
        for path, t in md.tensors():
            assert t.is_cuda, f"{path}: computed off the tensors' device"
        expected = ref_compute_attn_info(_ref(seqs, cfg, is_prompt), cfg)
        assert_matches_reference(md.to("cpu"), expected, cfg)
