"""``prepare_decode_inplace`` (docs/design.md section 12) against the eager ``prepare_decode``, exactly.

- named cases + hypothesis random decode batches: every field equal (``metadata_diff`` with
  ``cfg``, so only the defined ``block_tables`` columns count), before and after
  ``compute_attn_info``; on the CPU through the torch emulation, on CUDA through the Triton
  kernels (those parametrizations skip without a GPU);
- ``out`` captured for a larger batch: every write lands in the prefixes (no new tensor, same
  ``data_ptr``), stacked per-ratio fields are row views of ONE buffer, the tail rows are inert;
- staging: reuse, growth, ``fixed``; validation errors identical to ``prepare_decode``;
- the real Triton kernels under ``TRITON_INTERPRET=1`` in a subprocess (this file run as a
  script): equal to ``prepare_decode`` AND bit-identical to the emulation over the full buffers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import sys
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from cpmeta.config import MetadataConfig
from cpmeta.builders.decode import prepare_decode
from cpmeta.gpu.decode_inplace import (
    DecodeStaging,
    launch_decode_inplace,
    prepare_decode_inplace,
    staging_capacity,
)
from cpmeta.diff import metadata_diff
from cpmeta.metadata import InputMetadata
from cpmeta.constants import PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from cpmeta.sequence import SequenceMetadata
from strategies import decode_cases, metadata_prefix, random_config, random_decode_batch

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
STACKED = ("klen", "positions_c", "slot_mapping_store_ca", "kv_ca_index_offset_len")

#: (device, backend) pairs exercised in-process; CUDA ones skip without a GPU.
TARGETS = [
    pytest.param("cpu", "torch", id="cpu-emulate"),
    pytest.param("cuda", "triton", id="cuda-triton", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")]),
    pytest.param("cuda", "torch", id="cuda-emulate", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]


# ---- helpers --------------------------------------------------------------------------------


def _seq(q: int, k: int, table: list[int], state: int, *, ph: bool = False,
         comp: tuple[int, ...] = (), tokens: Optional[list[int]] = None) -> SequenceMetadata:
    toks = tokens if tokens is not None else [(7 * i + 3) % 50 for i in range(k)]
    return SequenceMetadata(
        seqlen_q=q, seqlen_k=k, block_table=table, state_id=state, token_ids=toks[: k - q + 1],
        is_placeholder=ph, draft_tokens=toks[k - q + 1:k], compressed_token_ids=comp,
    )


def assert_same(ref: InputMetadata, got: InputMetadata, cfg: MetadataConfig, *, derived: bool = True) -> None:
    """Every field equal (devices may differ); then again after compute_attn_info on both."""
    diff = metadata_diff(got, ref, cfg=cfg)
    assert not diff, diff
    if derived:
        ref.compute_attn_info(cfg)
        got.compute_attn_info(cfg)
        diff = metadata_diff(got, ref, cfg=cfg)
        assert not diff, diff


def _named_cases() -> dict[str, tuple[MetadataConfig, list[SequenceMetadata]]]:
    lookup = torch.tensor([(5 * i + 1) % 40 for i in range(50)], dtype=torch.int32)
    return {
        "one_row_each": (MetadataConfig.compressed_swa(), [_seq(1, 5, [3], 2), _seq(1, 300, [9, 8, 7], 0)]),
        "drafts_mixed": (
            MetadataConfig.compressed_swa(block_size=16, dense_compress_ratios=(4, 16), sparse_compress_ratios=(2,)),
            [_seq(3, 40, [1, 2, 3], 4), _seq(1, 17, [5, 6], 1), _seq(2, 2, [0], 3)],
        ),
        "placeholder_rows": (
            MetadataConfig.compressed_swa(block_size=8, window_size=4, swa_block_size=5),
            [_seq(2, 16, [4, 5], 1, ph=True), _seq(3, 24, [7, 8, 9], 2)],
        ),
        "ring_wrap_small_S": (
            MetadataConfig(block_size=4, window_size=2, swa_block_size=2, dense_compress_ratios=(1,),
                           sparse_compress_ratios=()),
            [_seq(3, 9, list(range(20, 29)), 6)],
        ),
        "below_min_ratio": (
            MetadataConfig.compressed_swa(block_size=32, dense_compress_ratios=(8,), sparse_compress_ratios=(16,)),
            [_seq(1, 3, [], 0), _seq(2, 7, [], 1), _seq(1, 40, [11, 12], 2)],
        ),
        "no_dense": (
            MetadataConfig.compressed_swa(block_size=16, dense_compress_ratios=(), sparse_compress_ratios=(4,)),
            [_seq(2, 33, [1, 2, 3], 0)],
        ),
        "engram_image_lookup_history": (
            MetadataConfig.compressed_swa(block_size=8, max_ngram_size=3, ngram_pad_token=1000, ngram_lookup=lookup,
                           image_token_id=5, force_load_balance=True),
            [_seq(3, 12, [1, 2], 0, tokens=[1, 2, 5, 4, 9, 8, 7, 6, 3, 2, 5, 9], comp=(30, 31, 32, 33)),
             _seq(1, 1, [0], 1), _seq(2, 3, [4], 2, comp=(9,))],
        ),
        "engram_identity": (
            MetadataConfig.compressed_swa(block_size=8, max_ngram_size=2),
            [_seq(2, 6, [3], 0), _seq(1, 9, [1, 2], 1)],
        ),
        # docs/design.md section 14: a plain paged-KV model (no ratios, no sliding window), its KV sharded over 3
        # ranks (tables of rank 0's share: 300 keys -> 100 -> 7 blocks), and each feature alone
        "plain": (
            MetadataConfig(block_size=16, max_model_len=256, dense_compress_ratios=(), sparse_compress_ratios=(),
                           window_size=0),
            [_seq(2, 17, [4, 9], 1), _seq(1, 5, [3], 0, ph=True), _seq(3, 40, [5, 6, 7], 2)],
        ),
        "plain_kv_sharded_interleaved": (
            MetadataConfig(block_size=16, max_model_len=300, dense_compress_ratios=(), sparse_compress_ratios=(),
                           window_size=0, kv_cp_world_size=3, kv_cp_interleave=4),
            [_seq(1, 300, list(range(10, 17)), 0), _seq(2, 40, [1], 1)],
        ),
        "swa_only": (
            MetadataConfig(block_size=8, window_size=4, swa_block_size=5, dense_compress_ratios=(),
                           sparse_compress_ratios=()),
            [_seq(2, 16, [4, 5], 1), _seq(3, 24, [7, 8, 9], 2)],
        ),
        "compressed_only": (
            MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(4,), sparse_compress_ratios=(2,)),
            [_seq(3, 40, [1, 2, 3], 4), _seq(1, 17, [5, 6], 1)],
        ),
    }


NAMED = _named_cases()


# ---- equality ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device,backend", TARGETS)
@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_case_equals_prepare_decode(name: str, device: str, backend: str) -> None:
    cfg, seqs = NAMED[name]
    got = prepare_decode_inplace(seqs, cfg, device=device, backend=backend)
    assert got.positions.device.type == device
    assert_same(prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks), got, cfg)


def test_named_case_hand_values() -> None:
    """A few values checked by hand (so the case table cannot silently agree on a wrong answer).

    drafts_mixed, sequence 0: seqlen_q 3, seqlen_k 40 -> positions 37, 38, 39; row 2 (pos 39)
    closes compressed token 9 of ratio 4 (b_c = 4): slot = table[9 // 4] * 4 + 9 % 4 = 3*4 + 1 = 13;
    klen["2"] = 40 // 2 = 20.
    """
    cfg, seqs = NAMED["drafts_mixed"]
    md = prepare_decode_inplace(seqs, cfg, device="cpu", backend="torch")
    assert md.positions[:3].tolist() == [37, 38, 39]
    assert md.slot_mapping_store_ca["4"][:3].tolist() == [-1, -1, 13]
    assert md.klen["2"][:3].tolist() == [19, 19, 20]
    assert md.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert md.block_tables[2, :3].tolist() == [1, 2, 3]  # cdiv(40 // 2, 16 // 2) = 3 defined
    assert md.block_tables[3, :1].tolist() == [5]  # seqlen_k 17: cdiv(8, 8) = 1 defined


@pytest.mark.parametrize("device,backend", TARGETS)
@SETTINGS
@given(case=decode_cases())
def test_random_batches_equal_prepare_decode(case: Any, device: str, backend: str) -> None:
    cfg, seqs = case
    assert_same(prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks), prepare_decode_inplace(seqs, cfg, device=device, backend=backend), cfg)


# ---- out buffers captured for a larger batch ---------------------------------------------------


def _check_tail(out: dict[str, torch.Tensor], md: InputMetadata, cfg: MetadataConfig) -> None:
    tq, n = md.total_q, md.num_seqs
    assert (out["positions"][tq:] == 0).all() and (out["context_lens"][tq:] == 0).all()
    assert not out["valid_token_mask"][tq:].any()
    assert (out["query_indices"][tq:] == PLACEHOLDER_QUERY_INDEX).all()
    assert cfg.has_swa == ("slot_mapping_store_swa" in out) == ("kv_swa_index_offset_len" in out)
    assert cfg.has_compressed_kv == ("klen" in out) == ("slot_mapping_store_ca" in out)
    if cfg.has_swa:
        assert (out["slot_mapping_store_swa"][tq:] == PAD_SLOT_ID).all()
        assert (out["kv_swa_index_offset_len"][tq:] == 0).all()
    if cfg.has_compressed_kv:
        assert (out["slot_mapping_store_ca"][:, tq:] == PAD_SLOT_ID).all()
        assert (out["kv_ca_index_offset_len"][:, tq:] == 0).all()
        assert (out["klen"][:, tq:] == 0).all()
    assert (out["cu_seqlens_q"][n + 1:] == tq).all()
    assert (out["cu_seqlens_k"][n + 1:] == md.cu_seqlens_k[-1]).all()


@pytest.mark.parametrize("device,backend", TARGETS)
def test_out_prefix_writes_in_place(device: str, backend: str) -> None:
    rng = random.Random(11)
    cfg = random_config(rng, max_ngram_size=2, dense_compress_ratios=(2, 4), sparse_compress_ratios=(4,),
                        block_size=16)
    big = random_decode_batch(rng, cfg, n_seqs=12, max_drafts=3)
    out: dict[str, torch.Tensor] = {}
    st = DecodeStaging(device)
    assert_same(prepare_decode(big, cfg, table_width=cfg.max_num_blocks), prepare_decode_inplace(big, cfg, out=out, device=device,
                                                                backend=backend, staging=st), cfg)
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    shapes = {k: v.shape for k, v in out.items()}
    for seed in range(8):
        small = random_decode_batch(random.Random(seed), cfg, n_seqs=1 + seed % 6, max_drafts=2)
        md = prepare_decode_inplace(small, cfg, out=out, device=device, backend=backend, staging=st)
        assert {k: v.data_ptr() for k, v in out.items()} == ptrs, "a buffer was reallocated"
        assert {k: v.shape for k, v in out.items()} == shapes
        assert_same(prepare_decode(small, cfg, table_width=cfg.max_num_blocks), md, cfg, derived=False)
        for name in STACKED if cfg.has_compressed_kv else ():
            stacked = out[name]
            for i, view in enumerate(getattr(md, name).values()):
                assert view.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
                assert view.stride() == stacked.stride()[1:]
                assert view.data_ptr() == stacked[i].data_ptr()
        assert md.positions.data_ptr() == ptrs["positions"]
        _check_tail(out, md, cfg)


def test_out_row_capacity_mismatch_is_an_error() -> None:
    cfg, seqs = NAMED["one_row_each"]
    out: dict[str, torch.Tensor] = {"positions": torch.zeros(8, dtype=torch.int32),
                                    "input_ids": torch.zeros(6, dtype=torch.int32)}
    with pytest.raises(ValueError, match="input_ids"):
        prepare_decode_inplace(seqs, cfg, out=out, device="cpu")
    out = {"positions": torch.zeros(1, dtype=torch.int32)}
    with pytest.raises(ValueError, match="positions"):
        prepare_decode_inplace(seqs, cfg, out=out, device="cpu")


def test_changed_out_is_rechecked() -> None:
    """The per-staging buffer cache must notice a replaced tensor (and a new out dict)."""
    cfg, seqs = NAMED["drafts_mixed"]
    st, out = DecodeStaging("cpu"), {}
    prepare_decode_inplace(seqs, cfg, out=out, device="cpu", staging=st)
    out["context_lens"] = torch.zeros(out["positions"].shape[0] + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="context_lens"):
        prepare_decode_inplace(seqs, cfg, out=out, device="cpu", staging=st)
    out2: dict[str, torch.Tensor] = {}
    md = prepare_decode_inplace(seqs, cfg, out=out2, device="cpu", staging=st)
    assert md.positions.data_ptr() == out2["positions"].data_ptr()
    with pytest.raises(ValueError, match="q_cap="):  # larger than the captured capacity
        prepare_decode_inplace(seqs + [dataclasses.replace(x, state_id=x.state_id + 100) for x in seqs], cfg,
                               out=out2, device="cpu", staging=st)


def test_launch_only_replays_new_staging() -> None:
    """The capture API: kernels only, full-capacity views, reading whatever was staged last."""
    rng = random.Random(5)
    cfg = random_config(rng)
    # 15 one-row sequences: room for any small batch below (<= 5 sequences of <= 3 rows)
    big = random_decode_batch(rng, cfg, n_seqs=15, max_drafts=0)
    st = DecodeStaging("cpu", staging_capacity(cfg, 15, 24), fixed=True)
    out: dict[str, torch.Tensor] = {}
    prepare_decode_inplace(big, cfg, out=out, device="cpu", staging=st)
    for seed in range(5):
        small = random_decode_batch(random.Random(100 + seed), cfg, n_seqs=1 + seed, max_drafts=2)
        staged = st.stage(small, cfg)
        md = launch_decode_inplace(st, cfg, out=out)
        assert md.positions.data_ptr() == out["positions"].data_ptr()
        assert md.positions.shape[0] == out["positions"].shape[0]
        ref = prepare_decode(small, cfg, table_width=cfg.max_num_blocks)
        cut = metadata_prefix(md, staged.num_seqs, staged.total_q)
        assert not metadata_diff(cut, ref, cfg=cfg)




# ---- staging -------------------------------------------------------------------------------------


def test_staging_grows_and_is_reused() -> None:
    cfg, seqs = NAMED["drafts_mixed"]
    st = DecodeStaging("cpu", capacity=4)
    md = prepare_decode_inplace(seqs, cfg, device="cpu", staging=st)
    assert st.capacity >= 4 and not metadata_diff(md, prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks), cfg=cfg)
    buf = st.host_buffer.data_ptr()
    prepare_decode_inplace(seqs[:1], cfg, device="cpu", staging=st)
    assert st.host_buffer.data_ptr() == buf, "a smaller batch must reuse the staging buffer"


def test_fixed_staging_too_small_is_an_error() -> None:
    cfg, seqs = NAMED["drafts_mixed"]
    st = DecodeStaging("cpu", capacity=8, fixed=True)
    with pytest.raises(ValueError, match="staging"):
        prepare_decode_inplace(seqs, cfg, device="cpu", staging=st)


def test_staging_capacity_bounds_any_batch() -> None:
    rng = random.Random(3)
    for _ in range(20):
        cfg = random_config(rng)
        seqs = random_decode_batch(rng, cfg, max_drafts=3)
        n, tq = len(seqs), sum(s.seqlen_q for s in seqs)
        st = DecodeStaging("cpu", staging_capacity(cfg, n, tq), fixed=True)
        assert st.stage(seqs, cfg).used <= st.capacity


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    dict(seqlen_q=0), dict(seqlen_q=9), dict(state_id=-1), dict(block_table=[]),
    dict(draft_tokens=()), dict(token_ids=[1]),
])
def test_invalid_input_same_error_as_prepare_decode(bad: dict[str, Any]) -> None:
    cfg = MetadataConfig.compressed_swa(block_size=16)
    seqs = [_seq(1, 5, [1], 0), _seq(2, 40, [1, 2, 3], 1)]
    fields = {f: getattr(seqs[1], f) for f in SequenceMetadata.__slots__}
    seqs[1] = SequenceMetadata(**{**fields, **bad})
    with pytest.raises(ValueError) as want:
        prepare_decode(seqs, cfg)
    with pytest.raises(ValueError) as got:
        prepare_decode_inplace(seqs, cfg, device="cpu")
    assert str(got.value) == str(want.value)
    assert "seqs[1]" in str(got.value)


def test_int32_overflow_checked_before_writing() -> None:
    cfg = MetadataConfig.compressed_swa(block_size=128, dense_compress_ratios=(1,), sparse_compress_ratios=(),
                         max_model_len=2**20)
    seqs = [_seq(1, 2, [0], i) for i in range(2048)]
    with pytest.raises(ValueError, match="kv_ca_index_offset_len"):
        prepare_decode_inplace(seqs, cfg, device="cpu")
    big_block = [_seq(1, 8, [2**26], 0)]  # 2**26 * (128 // 4) overflows the compressed slot
    for build in (prepare_decode, lambda s, c: prepare_decode_inplace(s, c, device="cpu")):
        with pytest.raises(ValueError, match="slot_mapping_store_ca"):
            build(big_block, MetadataConfig.compressed_swa())


def test_bad_backend_and_device() -> None:
    cfg, seqs = NAMED["one_row_each"]
    with pytest.raises(ValueError, match="backend"):
        prepare_decode_inplace(seqs, cfg, device="cpu", backend="cuda")
    if HAS_TRITON and not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            prepare_decode_inplace(seqs, cfg, device="cpu", backend="triton")
    with pytest.raises(ValueError, match="device: expected a CPU or CUDA device"):
        DecodeStaging("meta")  # (a staging buffer holds real bytes: refused when made)
    if torch.cuda.is_available():  # a staging buffer of another device
        with pytest.raises(ValueError, match="staging"):
            prepare_decode_inplace(seqs, cfg, device="cpu", staging=DecodeStaging("cuda"))


# ---- the real Triton kernels in the interpreter --------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_in_interpreter() -> None:
    from triton_interpret import run_interpreted

    run_interpreted(__file__, "interpreter cases passed")


def _filled_out(cfg: MetadataConfig, n_cap: int, q_cap: int, fill: int) -> dict[str, torch.Tensor]:
    """Buffers of a larger batch pre-filled with garbage, built by one eager call then overwritten."""
    big = [_seq(1, 3 + 5 * i, list(range(200)), i) for i in range(n_cap - 1)]
    big.append(_seq(q_cap - (n_cap - 1), 60, list(range(200)), n_cap - 1))  # state ids distinct
    out: dict[str, torch.Tensor] = {}
    prepare_decode_inplace(big, cfg, out=out, device="cpu", backend="torch")
    for t in out.values():
        t.fill_(fill if t.dtype != torch.bool else bool(fill % 2))
    return out


def _interpreter_main(n_random: int = 30) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: triton backend vs prepare_decode and vs emulation."""
    for name, (cfg, seqs) in NAMED.items():
        assert_same(prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks), prepare_decode_inplace(seqs, cfg, device="cpu", backend="triton"), cfg)
    rng = random.Random(1234)
    for i in range(n_random):
        cfg = random_config(rng, max_model_len=rng.choice([64, 200, 512]))
        seqs = random_decode_batch(rng, cfg, max_drafts=3)
        n, tq = len(seqs), sum(s.seqlen_q for s in seqs)
        outs = []
        for backend in ("triton", "torch"):
            out = _filled_out(cfg, n + 2, tq + 5, fill=-7)
            md = prepare_decode_inplace(seqs, cfg, out=out, device="cpu", backend=backend)
            assert_same(prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks), md, cfg, derived=(i % 3 == 0))
            outs.append(out)
        for key in outs[0]:  # full buffers, tail included: both wrote exactly the same elements
            assert torch.equal(outs[0][key], outs[1][key]), (i, key)
    print(f"{len(NAMED) + n_random} interpreter cases passed")


if __name__ == "__main__":
    if "--interpret" in sys.argv:  # the script's directory (tests/) is on sys.path already
        _interpreter_main()
