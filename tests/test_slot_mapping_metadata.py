"""Slot mapping from received metadata (docs/design.md section 11): ``stack_block_tables`` and
``compute_slot_mapping_from_metadata`` on prompt (``seq_block_tables``, CP mirror, placeholders)
and decode (``block_tables``) metadata. Split from tests/test_slot_mapping.py.
"""

from __future__ import annotations

import pytest
import torch

import cpmeta
from cpmeta import InputMetadata, compute_slot_mapping
from cpmeta.constants import PLACEHOLDER_QUERY_INDEX
from cpmeta.cp.slot_mapping_metadata import compute_slot_mapping_from_metadata, stack_block_tables


def test_stack_block_tables() -> None:
    assert stack_block_tables([[4, 7], [2]]).tolist() == [[4, 7], [2, -1]]
    assert stack_block_tables([[4], []], width=3).tolist() == [[4, -1, -1], [-1, -1, -1]]
    assert stack_block_tables([]).shape == (0, 0)
    with pytest.raises(ValueError, match="width"):
        stack_block_tables([[1, 2]], width=1)


def test_from_metadata_prompt_with_placeholder_and_cp() -> None:
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    positions = torch.tensor([4, 5, 6, 0, 1], dtype=torch.int32)
    md = InputMetadata(cu_seqlens_q=cu, positions=torch.zeros(2, dtype=torch.int32), positions_cp=positions,
                       query_indices=torch.tensor([0, 0, 0, PLACEHOLDER_QUERY_INDEX, PLACEHOLDER_QUERY_INDEX],
                                                  dtype=torch.int32))
    bt = stack_block_tables([[3, 8], [5]])
    got = compute_slot_mapping_from_metadata(md, 4, block_table=bt, cp_world_size=2, cp_rank=1,
                                             max_num_tokens=6)
    full = compute_slot_mapping(cu, positions, bt, 4, max_num_tokens=6, cp_world_size=2, cp_rank=1)
    # rank 1 owns odd positions; pos 5: vbo=5, local=2 -> block 3, offset 2; pos 1 -> block 5
    assert full.tolist() == [-1, 3 * 4 + 2, -1, -1, 5 * 4 + 0, -1]
    assert got.tolist() == [-1, 14, -1, -1, -1, -1]  # sequence 1 is a placeholder
    with pytest.raises(ValueError, match="block_table"):
        compute_slot_mapping_from_metadata(md, 4)
    # the broadcast carries the tables itself (seq_block_tables): no block_table= needed
    md.seq_block_tables = bt
    assert compute_slot_mapping_from_metadata(md, 4, cp_world_size=2, cp_rank=1,
                                              max_num_tokens=6).tolist() == got.tolist()


def test_from_metadata_prompt_built_and_mirrored_needs_no_scheduler() -> None:
    """prepare_prompt -> mirror -> slot mapping from the metadata alone = the explicit tables."""
    cfg = cpmeta.MetadataConfig(block_size=16, window_size=4, swa_block_size=8,
                                dense_compress_ratios=(4,), sparse_compress_ratios=(4,), max_model_len=128)
    seqs = [cpmeta.SequenceMetadata(5, 40, [9, 3, 6, 11], 0, list(range(40))),
            cpmeta.SequenceMetadata(7, 7, [2], 1, list(range(7)))]
    md = cpmeta.prepare_prompt(seqs, cfg)
    assert md.seq_block_tables.tolist() == [[9, 3, 6, 11], [2, -1, -1, -1]]
    bt = stack_block_tables([s.block_table for s in seqs])
    for rank in range(2):
        mine = cpmeta.prepare_for_mirror_cp(md, rank, 2)
        assert mine.seq_block_tables is md.seq_block_tables  # whole-sequence field: carried over
        got = compute_slot_mapping_from_metadata(mine, 16, cp_world_size=2, cp_rank=rank, cp_interleave=4)
        want = compute_slot_mapping_from_metadata(mine, 16, block_table=bt, cp_world_size=2,
                                                  cp_rank=rank, cp_interleave=4)
        assert torch.equal(got, want)


def test_from_metadata_decode_uses_block_tables() -> None:
    md = InputMetadata(cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32),
                       positions=torch.tensor([9, 10, 3], dtype=torch.int32),
                       block_tables=torch.tensor([[1, 2, 3], [1, 2, 3], [7, 0, 0]], dtype=torch.int32))
    assert compute_slot_mapping_from_metadata(md, 4).tolist() == [3 * 4 + 1, 3 * 4 + 2, 7 * 4 + 3]  # pos 9, 10 -> block index 2 (id 3)


def test_from_metadata_with_the_config_reads_its_kv_sharding() -> None:
    """``compute_slot_mapping_from_metadata(md, cfg, cp_rank=r)``: block size and KV sharding from
    the config (what ``cp_kv_read_plan`` reads), equal to spelling them out; replicated KV
    (``kv_cp_world_size == 1``) stores every key on every rank."""
    plain = dict(block_size=16, max_model_len=256, dense_compress_ratios=(), sparse_compress_ratios=(),
                 window_size=0)
    seqs = [cpmeta.SequenceMetadata(30, 70, [9, 3, 6], 0, list(range(70))),
            cpmeta.SequenceMetadata(7, 7, [2], 1, list(range(7)))]
    sharded = cpmeta.MetadataConfig(**plain, kv_cp_world_size=3, kv_cp_interleave=4)
    md = cpmeta.prepare_prompt(seqs, sharded)
    for rank in range(3):
        got = compute_slot_mapping_from_metadata(md, sharded, cp_rank=rank)
        want = compute_slot_mapping_from_metadata(md, 16, cp_world_size=3, cp_rank=rank, cp_interleave=4)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="cp_world_size"):
        compute_slot_mapping_from_metadata(md, sharded, cp_rank=0, cp_world_size=3)
    replicated = cpmeta.MetadataConfig(**plain)
    md = cpmeta.prepare_prompt([cpmeta.SequenceMetadata(30, 70, [9, 3, 6, 1, 4], 0, list(range(70)))], replicated)
    every = compute_slot_mapping_from_metadata(md, 16)
    assert (every >= 0).all()
    for rank in range(3):
        assert torch.equal(compute_slot_mapping_from_metadata(md, replicated, cp_rank=rank), every)
