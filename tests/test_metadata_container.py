"""``InputMetadata`` container operations (docs/design.md section 6) and its field catalog (4, 5, 8)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpmeta
from cpmeta import InputMetadata, get_or_create_stacked, get_or_create_tensor

# Field catalog from docs/design.md sections 4, 5 and 8, written out independently of metadata.py.
DESIGN_FIELDS = """
positions input_ids gate_force_random ngram_token_ids cu_seqlens_q cu_seqlens_k valid_token_mask
query_indices positions_c slot_mapping_store_ca slot_mapping_store_swa num_seqs total_q max_seqlen_q
max_seqlen_k is_prompt cu_compressed_seqlens_q state_block_idx total_k_swa load_segments_swa
cu_compressed_seqlens_k load_segments_ca total_k_compressed ks ke kv_ca_index_offset_len
kv_swa_full_index_pivots context_lens klen kv_swa_index_offset_len block_tables kv_ca_index
kv_ca_index_len kv_swa_full_index kv_swa_index mirror_cp_index mirror_cp_reverse_index cp_mirror_len
cp_rank cp_size positions_cp gate_force_random_cp seq_block_tables
""".split()
DICT_FIELDS = frozenset("""
positions_c slot_mapping_store_ca cu_compressed_seqlens_q cu_compressed_seqlens_k load_segments_ca
total_k_compressed ks ke kv_ca_index_offset_len klen kv_ca_index kv_ca_index_len yoco_consumer_ks
yoco_consumer_ke yoco_consumer_kv_ca_index_offset_len
""".split())
SCALARS = frozenset("""
is_prompt num_seqs total_q max_seqlen_q max_seqlen_k total_k_swa cp_rank cp_size cp_mirror_len
yoco_consumer_total_q yoco_consumer_cp_mirror_len yoco_consumer_cp_contrib_pad_len
""".split())
FIELDS = InputMetadata.field_names()
TENSOR_FIELDS = tuple(f for f in FIELDS if f not in DICT_FIELDS and f not in SCALARS)


def test_catalog_has_every_design_field_defaulting_to_none() -> None:
    missing = [f for f in DESIGN_FIELDS if f not in FIELDS]
    assert not missing, f"InputMetadata lacks {missing}"
    md = InputMetadata()
    assert all(getattr(md, f) is None for f in FIELDS)
    assert DICT_FIELDS <= set(FIELDS) and SCALARS <= set(FIELDS)


def test_clean_list() -> None:
    md = InputMetadata()
    clean = md.get_clean_list()
    assert {"kv_ca_index_len", "kv_swa_index", "kv_ca_index", "kv_swa_full_index"} <= set(clean)
    for name in clean:
        setattr(md, name, torch.zeros(1))
    md.positions = torch.zeros(3)
    md.clean_derived_()
    assert all(getattr(md, name) is None for name in clean)
    assert md.positions is not None  # only derived fields are reset


# ---- random metadata ------------------------------------------------------------------------

_DTYPES = [torch.int32, torch.int64, torch.bool, torch.float32]
_KEYS = ["1", "4", "8", "128"]


@st.composite
def _tensor(draw: Any) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 4), max_size=2))
    dtype = draw(st.sampled_from(_DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype == torch.float32:
        return torch.rand(shape, generator=g)
    return torch.randint(0, 2 if dtype == torch.bool else 1000, shape, generator=g).to(dtype)


@st.composite
def random_metadata(draw: Any) -> InputMetadata:
    """A random subset of fields set: tensors, scalars, dicts of tensors (empty dicts too)."""
    kw: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=len(FIELDS))):
        if name in SCALARS:
            kw[name] = draw(st.one_of(st.integers(-5, 10**6), st.booleans()))
        elif name == "total_k_compressed":
            kw[name] = draw(st.dictionaries(st.sampled_from(_KEYS), st.integers(0, 10**6), max_size=3))
        elif name in DICT_FIELDS:
            kw[name] = draw(st.dictionaries(st.sampled_from(_KEYS), _tensor(), max_size=3))
        else:
            kw[name] = draw(_tensor())
    return InputMetadata(**kw)


def _assert_same(a: InputMetadata, b: InputMetadata) -> None:
    """Same values field by field; tensors are the SAME objects (flattening copies nothing)."""
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, dict):
            assert isinstance(y, dict) and x.keys() == y.keys(), name
            for k in x:
                assert y[k] is x[k] or (not isinstance(x[k], torch.Tensor) and y[k] == x[k]), f"{name}.{k}"
        elif isinstance(x, torch.Tensor):
            assert y is x, name
        else:
            assert y == x and type(y) is type(x), name


@settings(max_examples=80, deadline=None)
@given(md=random_metadata())
def test_flatten_round_trip(md: InputMetadata) -> None:
    flat = md.to_flatten_dict()
    for name in FIELDS:
        v = getattr(md, name)
        if isinstance(v, dict) and v:
            assert name not in flat
            assert {k for k in flat if k.startswith(name + ".")} == {f"{name}.{k}" for k in v}
        else:
            assert name in flat, name
            if isinstance(v, dict):
                assert flat[name] == {}, name  # an empty dict stays a value
            else:
                assert flat[name] is v, name
    assert not any(isinstance(v, dict) and v for v in flat.values())  # one level only
    _assert_same(md, InputMetadata.from_flatten_dict(flat))


def test_empty_dict_is_kept_as_a_value() -> None:
    md = InputMetadata(ks={}, klen={"4": torch.arange(3)})
    flat = md.to_flatten_dict()
    assert flat["ks"] == {} and "ks.4" not in flat
    assert "klen" not in flat and flat["klen.4"] is md.klen["4"]
    back = InputMetadata.from_flatten_dict(flat)
    assert back.ks == {} and back.ks is not None
    assert back.klen == {"4": md.klen["4"]}
    assert back.ke is None


def test_two_level_dict_is_a_type_error_naming_the_path() -> None:
    md = InputMetadata(klen={"4": {"x": torch.zeros(1)}})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=re.escape("klen.4")):
        md.to_flatten_dict()
    with pytest.raises(TypeError, match=re.escape("ks")):
        InputMetadata(ks={"4.1": torch.zeros(1)}).to_flatten_dict()  # key would split wrongly
    with pytest.raises(TypeError, match=re.escape("ks")):
        InputMetadata.from_flatten_dict({"ks": {"4": torch.zeros(1)}})  # non-empty dict not flattened


def test_from_flatten_dict_errors() -> None:
    with pytest.raises(KeyError, match="no_such_field"):
        InputMetadata.from_flatten_dict({"no_such_field": 1})
    with pytest.raises(TypeError, match=re.escape("klen")):
        InputMetadata.from_flatten_dict({"klen": torch.zeros(1), "klen.4": torch.zeros(1)})
    # not a dict, a key that is not a str, a copy from something else: named (were AttributeErrors)
    with pytest.raises(TypeError, match=r"^flat: expected a dict of field paths, got list$"):
        InputMetadata.from_flatten_dict(["positions"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^1: a field path is a str, got int$"):
        InputMetadata.from_flatten_dict({1: torch.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"^other: expected InputMetadata, got dict$"):
        InputMetadata().recursive_copy_({"positions": torch.zeros(1)})  # type: ignore[arg-type]


def test_split_at_the_first_dot() -> None:
    back = InputMetadata.from_flatten_dict({"klen.4": torch.zeros(2), "klen.128": torch.ones(2)})
    assert sorted(back.klen) == ["128", "4"]


# ---- recursive_copy_ ------------------------------------------------------------------------


def _pair() -> tuple[InputMetadata, InputMetadata]:
    dst = InputMetadata(total_q=3, positions=torch.zeros(3, dtype=torch.int32),
                        klen={"4": torch.zeros(3, dtype=torch.int32)}, ks={})
    src = InputMetadata(total_q=99, positions=torch.tensor([5, 6, 7], dtype=torch.int32),
                        klen={"4": torch.tensor([1, 1, 2], dtype=torch.int32)}, ks={})
    return dst, src


def test_recursive_copy_copies_tensors_in_place_not_scalars() -> None:
    dst, src = _pair()
    pos, k4 = dst.positions, dst.klen["4"]
    assert dst.recursive_copy_(src) is dst
    assert dst.positions is pos and dst.klen["4"] is k4  # same objects, new contents
    assert pos.tolist() == [5, 6, 7] and k4.tolist() == [1, 1, 2]
    assert pos.data_ptr() != src.positions.data_ptr()
    assert dst.total_q == 3  # scalars are the caller's job
    assert dst.ks == {}


def test_recursive_copy_skips_none_in_source() -> None:
    dst, src = _pair()
    src.klen = None
    dst.recursive_copy_(src)
    assert dst.klen["4"].tolist() == [0, 0, 0]


@pytest.mark.parametrize("path,bad", [
    ("positions", {"positions": torch.zeros(4, dtype=torch.int32)}),  # shape
    ("positions", {"positions": torch.zeros(3, dtype=torch.int64)}),  # dtype
    ("klen.4", {"klen": {"4": torch.zeros(2, dtype=torch.int32)}}),
    ("klen.8", {"klen": {"8": torch.zeros(3, dtype=torch.int32)}}),  # no destination
    ("context_lens", {"context_lens": torch.zeros(3, dtype=torch.int32)}),  # no destination
])
def test_recursive_copy_mismatch_is_a_clear_error(path: str, bad: dict[str, Any]) -> None:
    dst, src = _pair()
    src = dataclasses.replace(src, **bad)
    with pytest.raises(ValueError, match=re.escape(path)):
        dst.recursive_copy_(src)


# ---- get_or_create_tensor / get_or_create_stacked ---------------------------------------------


def test_get_or_create_tensor_allocates_without_out() -> None:
    t = get_or_create_tensor(None, "positions", (3, 2), torch.int32)
    assert tuple(t.shape) == (3, 2) and t.dtype == torch.int32
    out: dict[str, torch.Tensor] = {}
    t2 = get_or_create_tensor(out, "positions", [5], torch.bool)
    assert out["positions"] is t2 and t2.dtype == torch.bool and tuple(t2.shape) == (5,)


def test_get_or_create_tensor_returns_the_given_tensor() -> None:
    buf = torch.zeros(4, 2, dtype=torch.int32)
    out = {"kv": buf}
    assert get_or_create_tensor(out, "kv", (4, 2), torch.int32) is buf
    with pytest.raises(ValueError, match="kv"):
        get_or_create_tensor(out, "kv", (4, 2), torch.int64)
    with pytest.raises(ValueError, match="kv"):
        get_or_create_tensor(out, "kv", (3, 2), torch.int32)  # smaller: only with allow_prefix
    prefix = get_or_create_tensor(out, "kv", (3, 2), torch.int32, allow_prefix=True)
    assert prefix.data_ptr() == buf.data_ptr() and tuple(prefix.shape) == (3, 2)
    with pytest.raises(ValueError, match="kv"):
        get_or_create_tensor(out, "kv", (5, 2), torch.int32, allow_prefix=True)  # larger than the buffer
    with pytest.raises(ValueError, match="kv"):
        get_or_create_tensor(out, "kv", (3, 3), torch.int32, allow_prefix=True)  # trailing dims differ


def test_get_or_create_stacked_views_share_one_storage() -> None:
    # keys ("4", "128"), shape (5,): one [2, 5] tensor, rows are views.
    out: dict[str, torch.Tensor] = {}
    stacked, views = get_or_create_stacked(out, "klen", ("4", "128"), (5,), torch.int32)
    assert tuple(stacked.shape) == (2, 5) and out["klen"] is stacked
    assert list(views) == ["4", "128"]
    base = stacked.untyped_storage().data_ptr()
    for i, k in enumerate(("4", "128")):
        assert views[k].untyped_storage().data_ptr() == base
        assert views[k].data_ptr() == stacked[i].data_ptr()
    stacked.zero_()
    views["128"].fill_(7)
    assert stacked.tolist() == [[0] * 5, [7] * 5]
    again, views2 = get_or_create_stacked(out, "klen", ("4", "128"), (5,), torch.int32)
    assert again is stacked and views2["128"].data_ptr() == views["128"].data_ptr()
    with pytest.raises(ValueError, match="klen"):
        get_or_create_stacked(out, "klen", ("4", "128"), (5,), torch.int64)
    with pytest.raises(ValueError, match="klen"):
        get_or_create_stacked(out, "klen", ("4",), (5,), torch.int32)


def test_get_or_create_stacked_prefix_mode() -> None:
    # a [2, 8, 2] buffer captured for 8 rows serves a 5-row batch through prefix views.
    buf = torch.zeros(2, 8, 2, dtype=torch.int32)
    out = {"off": buf}
    stacked, views = get_or_create_stacked(out, "off", ("4", "128"), (5, 2), torch.int32, allow_prefix=True)
    assert stacked is buf
    for i, k in enumerate(("4", "128")):
        assert tuple(views[k].shape) == (5, 2)
        assert views[k].data_ptr() == buf[i].data_ptr()
    views["128"][4] = torch.tensor([3, 4], dtype=torch.int32)
    assert buf[1, 4].tolist() == [3, 4]
    with pytest.raises(ValueError, match="off"):
        get_or_create_stacked(out, "off", ("4", "128"), (5, 2), torch.int32)  # prefix not allowed
    with pytest.raises(ValueError, match="off"):
        get_or_create_stacked(out, "off", ("4", "128"), (9, 2), torch.int32, allow_prefix=True)


def test_replace_is_a_shallow_copy() -> None:
    md = InputMetadata(positions=torch.zeros(2), total_q=2)
    other = md.replace(total_q=5)
    assert md.total_q == 2 and other.total_q == 5 and other.positions is md.positions


def test_tensors_yields_flattened_paths() -> None:
    t = torch.zeros(1)
    md = InputMetadata(positions=t, klen={"4": t}, ks={}, total_q=1)
    assert [(p, x is t) for p, x in md.tensors()] == [("positions", True), ("klen.4", True)]


def test_recursive_copy_into_a_fixed_width_table_names_table_width() -> None:
    """A graph's static metadata holds block_tables at a fixed width; a fresh build at the batch's
    width does not fit it, and the error says how to build one that does."""
    cfg = cpmeta.MetadataConfig(block_size=16, max_model_len=1024, window_size=0, dense_compress_ratios=(),
                                sparse_compress_ratios=())
    seqs = [cpmeta.SequenceMetadata(seqlen_q=1, seqlen_k=40, block_table=[1, 2, 3], state_id=0,
                                    token_ids=list(range(40)))]
    static = cpmeta.prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks)
    with pytest.raises(ValueError, match=r"block_tables: expected \(1, 64\).*got \(1, 16\).*table_width="):
        static.recursive_copy_(cpmeta.prepare_decode(seqs, cfg))
    static.recursive_copy_(cpmeta.prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks))
    assert static.block_tables[0, :4].tolist() == [1, 2, 3, -1]
