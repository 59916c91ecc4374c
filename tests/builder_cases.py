"""Named, hand-checked builder cases (docs/design.md sections 4 and 5), used by ``test_builders.py``.

Each case holds a config, a batch, the path it runs on, and a few values worked out BY HAND
(the arithmetic is in the comments) -- independent of both the reference and the builders.
``checks`` maps a path to its expected value; path syntax: ``field``, ``field.key``,
``field[i]`` or ``field.key[i]`` (``i`` = row of the plain list).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cpmeta.config import MetadataConfig
from cpmeta.sequence import SequenceMetadata

__all__ = ["NamedCase", "NAMED_CASES"]

PH = 998244353  # query_indices of a placeholder row


@dataclass
class NamedCase:
    name: str
    cfg: MetadataConfig
    seqs: list[SequenceMetadata]
    is_prompt: bool
    checks: dict[str, Any] = field(default_factory=dict)


def _seq(q: int, k: int, bt: list[int], state: int, tok0: int = 100, **kw: Any) -> SequenceMetadata:
    """A prompt sequence whose tokens are ``tok0 + position``."""
    return SequenceMetadata(q, k, bt, state, list(range(tok0, tok0 + k)), **kw)


def _dec(q: int, k: int, bt: list[int], state: int, tok0: int = 100, **kw: Any) -> SequenceMetadata:
    """A decode sequence: ``k - q + 1`` tokens ``tok0 + position``, drafts ``900 + d``."""
    n_tok = k - q + 1
    return SequenceMetadata(q, k, bt, state, list(range(tok0, tok0 + n_tok)),
                            draft_tokens=[900 + d for d in range(q - 1)], **kw)


# bs=16, W=4, S=6, ratios (4,)/(4,): b_c = 4 compressed tokens per block.
C1 = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                    sparse_compress_ratios=(4,), max_model_len=64)


def _first_chunk() -> NamedCase:
    # q_start = 0, positions 0..9. ratio 4: c in [0, 2) -> positions_c 0, 4; slots 7*4+0, 7*4+1.
    # SWA write: only the last S=6 rows (seqlen_q - j <= 6, j >= 4): 2*6 + pos % 6.
    # SWA load: hist [-4, 0): all padding -> one zero fill [-1, 0, 4, 0].
    # pivots row 5 (pos 5): abs_lo = max(5-4+1, 0) = 2, sec1_lo = min(2, 0) = 0,
    #   start_slot = 0 - (0 - 4) = 4 -> P0 = 4, P1 = 0; k_lo = 2 -> P2 = 1*4 + 0 + 2 = 6, P3 = 4.
    return NamedCase("first_chunk", C1, [_seq(10, 10, [7, 3], 2)], True, {
        "seq_block_tables": [[7, 3]],  # the whole table, one sequence: no padding
        "positions": list(range(10)),
        "input_ids": list(range(100, 110)),
        "positions_c.4": [0, 4],
        "slot_mapping_store_ca.4": [28, 29],
        "cu_compressed_seqlens_q.4": [0, 2],
        "slot_mapping_store_swa": [-1, -1, -1, -1, 16, 17, 12, 13, 14, 15],
        "load_segments_swa": [[-1, 0, 4, 0]],
        "load_segments_ca.4": [[7, 0, 2, 0]],
        "total_k_compressed": {"4": 2},
        "ke.4": [0, 0, 0, 1, 1, 1, 1, 2, 2, 2],
        "kv_swa_full_index_pivots[0]": [4, 0, 4, 1],
        "kv_swa_full_index_pivots[5]": [4, 0, 6, 4],
        "kv_swa_full_index[0]": [4, -1, -1, -1],
        "kv_swa_full_index[5]": [6, 7, 8, 9],
        "kv_ca_index_len.4": [0, 0, 0, 1, 1, 1, 1, 2, 2, 2],
    })


def _chunk_lt_w() -> NamedCase:
    # W=8, S=10; q_start=5 < W, rows pos 5..8.
    # SWA load: hist [-3, 5): pad = 0 - (-3) = 3 -> [-1, 0, 3, 0]; ring [0, 5) -> [1, 0, 5, 3].
    # pivots pos 5: abs_lo 0, start_slot = 0 - (5 - 8) = 3 -> (3, 5, 8 + 0, 1);
    #   pos 8: abs_lo 1, start_slot 4 -> (4, 4, 8, 4), expanded 4..7 then 8..11.
    # ratio 4: c in [5//4, 9//4) = [1, 2) -> positions_c 4, slot 11*4 + 1 = 45.
    cfg = MetadataConfig(block_size=16, window_size=8, swa_block_size=10, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(4,), max_model_len=64)
    return NamedCase("chunk_qstart_lt_W", cfg, [_seq(4, 9, [11], 1, tok0=200)], True, {
        "positions": [5, 6, 7, 8],
        "input_ids": [205, 206, 207, 208],
        "load_segments_swa": [[-1, 0, 3, 0], [1, 0, 5, 3]],
        "kv_swa_full_index_pivots": [[3, 5, 8, 1], [3, 5, 8, 2], [3, 5, 8, 3], [4, 4, 8, 4]],
        "kv_swa_full_index[0]": [3, 4, 5, 6, 7, 8, -1, -1],
        "kv_swa_full_index[3]": [4, 5, 6, 7, 8, 9, 10, 11],
        "positions_c.4": [4],
        "slot_mapping_store_ca.4": [45],
        "ke.4": [1, 1, 2, 2],
        "slot_mapping_store_swa": [15, 16, 17, 18],
    })


def _chunk_gt_w() -> NamedCase:
    # W=4, S=16; q_start=13 > W, rows pos 13..17; state 3.
    # SWA load: hist [9, 13) all valid, slots 9..12 -> [3, 9, 13, 0].
    # SWA write (ring wraps at 16): 48 + pos % 16 = 61, 62, 63, 48, 49.
    # pivots pos 13: abs_lo 10, start_slot = 10 - 9 = 1 -> (1, 3, 4, 1);
    #   pos 17: abs_lo 14 > q_start -> P1 = 0, k_lo = 1 -> (4, 0, 5, 4).
    # ratio 4: c in [3, 4) -> positions_c 12, slot bt[0]*4 + 3 = 11.
    cfg = MetadataConfig(block_size=16, window_size=4, swa_block_size=16, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(4,), max_model_len=64)
    return NamedCase("chunk_qstart_gt_W", cfg, [_seq(5, 18, [2, 9], 3)], True, {
        "positions": [13, 14, 15, 16, 17],
        "load_segments_swa": [[3, 9, 13, 0]],
        "slot_mapping_store_swa": [61, 62, 63, 48, 49],
        "kv_swa_full_index_pivots[0]": [1, 3, 4, 1],
        "kv_swa_full_index_pivots[4]": [4, 0, 5, 4],
        "kv_swa_full_index[0]": [1, 2, 3, 4],
        "kv_swa_full_index[4]": [5, 6, 7, 8],
        "positions_c.4": [12],
        "slot_mapping_store_ca.4": [11],
        "load_segments_ca.4": [[2, 0, 4, 0]],
        "ke.4": [3, 3, 4, 4, 4],
    })


def _ring_wrap() -> NamedCase:
    # C1 (W=4, S=6). seq0 first chunk of 3; seq1 q_start=13, hist [9, 13): slots 3,4,5 | 0
    # -> split at the wrap: [3, 3, 6, 4 + 0], [3, 0, 1, 4 + 3] (dst base s*W = 4).
    # pivots seq1 pos 13: sec1_start 4, sec2_start = 2*4 + 3 = 11, start_slot 1 -> (5, 3, 11, 1).
    return NamedCase("ring_wrap", C1, [_seq(3, 3, [1], 0), _seq(5, 18, [2, 9], 3)], True, {
        "load_segments_swa": [[-1, 0, 4, 0], [3, 3, 6, 4], [3, 0, 1, 7]],
        "kv_swa_full_index_pivots[3]": [5, 3, 11, 1],
        "kv_swa_full_index[3]": [5, 6, 7, 11],
        "cu_seqlens_q": [0, 3, 8],
        "cu_seqlens_k": [0, 3, 21],
        "total_k_swa": 8,
        "state_block_idx": [0, 3],
    })


def _seqlen_k_lt_r() -> NamedCase:
    # dense (4,), sparse (8,); seq0 k=3 < 4, seq1 k=6 (q_start 4) < 8.
    # No compressed token completes in either chunk -> one dummy row each (0, -1).
    # loaded: max(1, k // n): ratio 4 -> 1, 1; ratio 8 -> 1, 1. Paged plan: zero fill for m == 0.
    # ks/ke ratio 8: seq1 base 1, ke = 1 + (pos+1)//8 = 1.
    cfg = MetadataConfig(block_size=16, window_size=4, swa_block_size=4, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(8,), max_model_len=64)
    return NamedCase("seqlen_k_lt_r", cfg, [_seq(3, 3, [5], 0), _seq(2, 6, [6], 1)], True, {
        "positions_c.4": [0, 0], "slot_mapping_store_ca.4": [-1, -1],
        "positions_c.8": [0, 0], "slot_mapping_store_ca.8": [-1, -1],
        "cu_compressed_seqlens_q.4": [0, 1, 2],
        "cu_compressed_seqlens_k.4": [0, 1, 2],
        "cu_compressed_seqlens_k.8": [0, 1, 2],
        "load_segments_ca.4": [[-1, 0, 1, 0], [6, 0, 1, 1]],
        "load_segments_ca.8": [[-1, 0, 1, 0], [-1, 0, 1, 1]],
        "total_k_compressed": {"4": 2, "8": 2},
        "ks.8": [0, 0, 0, 1, 1],
        "ke.8": [0, 0, 0, 1, 1],
        "kv_ca_index_offset_len.4": [[0, 0], [0, 0], [0, 0], [1, 1], [1, 1]],
        "kv_ca_index_len.4": [0, 0, 0, 1, 1],
        "kv_ca_index.4[3]": [1] + [-1] * 127,
    })


def _swa_valid_start() -> NamedCase:
    # W=4, S=8. seq0 q_start 10, valid from 8: hist [6, 10) -> pad 2 [-1,0,2,0], ring [8,10)
    #   slots 0,1 -> [0, 0, 2, 2]. pivots pos 10: abs_lo = max(7, 8) = 8, start_slot 2
    #   -> (2, 2, 2*4 + 0, 1); pos 12: abs_lo 9 -> (3, 1, 8, 3).
    # seq1 q_start 2, valid from 20 (beyond the chunk): all history padded [-1, 0, 4, 4];
    #   pos 2: abs_lo = clamp(20, 0, 3) = 3 -> nothing visible: (8, 0, 8 + 3 + 1, 0).
    cfg = MetadataConfig(block_size=16, window_size=4, swa_block_size=8, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(4,), max_model_len=64)
    seqs = [_seq(3, 13, [4], 0, swa_valid_start=8), _seq(2, 4, [5], 1, swa_valid_start=20)]
    return NamedCase("swa_valid_start", cfg, seqs, True, {
        "load_segments_swa": [[-1, 0, 2, 0], [0, 0, 2, 2], [-1, 0, 4, 4]],
        "kv_swa_full_index_pivots": [[2, 2, 8, 1], [2, 2, 8, 2], [3, 1, 8, 3], [8, 0, 12, 0], [8, 0, 13, 0]],
        "kv_swa_full_index[0]": [2, 3, 8, -1],
        "kv_swa_full_index[2]": [3, 8, 9, 10],
        "kv_swa_full_index[3]": [-1, -1, -1, -1],
    })


def _placeholder_prompt() -> NamedCase:
    # seq1 is a placeholder: its slots are -1, query_indices 998244353, mask False; its load
    # plan still reads its real block ([12, 0, 2, 1]: m = 8//4 = 2, dst = cu_k = 1).
    # seq0 q_start 3: ratio 4 c in [0, 1) -> slot 10*4 = 40; seq2 k=1: dummy (0, -1).
    seqs = [_seq(1, 4, [10], 4), _seq(2, 8, [12], 5, is_placeholder=True), _seq(1, 1, [13], 6)]
    return NamedCase("placeholder_prompt", C1, seqs, True, {
        "seq_block_tables": [[10], [12], [13]],  # a placeholder's table is carried like any other
        "query_indices": [0, PH, PH, 2],
        "valid_token_mask": [True, False, False, True],
        "slot_mapping_store_swa": [27, -1, -1, 36],
        "positions_c.4": [0, 4, 0],
        "slot_mapping_store_ca.4": [40, -1, -1],
        "load_segments_ca.4": [[10, 0, 1, 0], [12, 0, 2, 1], [-1, 0, 1, 3]],
    })


def _placeholder_decode() -> NamedCase:
    # the placeholder row pos 7 completes compressed token 1: positions_c 4, but slot -1.
    seqs = [_dec(1, 8, [3], 0, is_placeholder=True), _dec(1, 4, [9], 1)]
    return NamedCase("placeholder_decode", C1, seqs, False, {
        "query_indices": [PH, 1],
        "valid_token_mask": [False, True],
        "positions_c.4": [4, 0],
        "slot_mapping_store_ca.4": [-1, 9 * 4],
        "slot_mapping_store_swa": [-1, 6 + 3],
        "context_lens": [8, 4],
    })


def _mtp_drafts() -> NamedCase:
    # C1: block_tables width = the longest table (3) rounded up to 16, at most max_num_blocks =
    # cdiv(64//4, 16//4) = 4. seq0 q=3, k=10: 8 tokens 100..107, drafts
    # 900, 901 at pos 8, 9. SWA read: pos 7 -> w 4, start (7-3) % 6 = 4 -> 1*6 + 4 = 10;
    # pos 8 -> start 5: index [6+5, 6+0, 6+1, 6+2] (ring wrap). ratio 4 writes at pos 7
    # (c = 1, slot 3*4 + 1 = 13) and pos 3 of seq1 (c = 0, slot 7*4 = 28).
    # kv_ca offsets i * 4 * 4; row 1 (offset 16, len 2) -> flat block 4 = row 1 col 0 = 3
    # -> 3*4 + 0, 3*4 + 1.
    seqs = [_dec(3, 10, [3, 8, 9], 1), _dec(1, 4, [7], 2, tok0=60)]
    return NamedCase("mtp_drafts", C1, seqs, False, {
        "positions": [7, 8, 9, 3],
        "input_ids": [107, 900, 901, 63],
        "context_lens": [8, 9, 10, 4],
        "klen.4": [2, 2, 2, 1],
        "kv_swa_index_offset_len": [[10, 4], [11, 4], [6, 4], [12, 4]],
        "kv_swa_index[1]": [11, 6, 7, 8],
        "kv_swa_index[2]": [6, 7, 8, 9],
        "positions_c.4": [4, 0, 0, 0],
        "slot_mapping_store_ca.4": [13, -1, -1, 28],
        "slot_mapping_store_swa": [7, 8, 9, 15],
        "block_tables": [[3], [3], [3], [7]],
        "kv_ca_index_offset_len.4": [[0, 2], [16, 2], [32, 2], [48, 1]],
        "kv_ca_index.4[1]": [12, 13] + [-1] * 126,
        "kv_ca_index.4[3]": [28] + [-1] * 127,
        "state_block_idx": [1, 1, 1, 2],
        "query_indices": [0, 0, 0, 1],
    })


# Engram: 3 look-back columns, pad 0, image sentinel 5, lookup x -> x + 100.
ENGRAM = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                        sparse_compress_ratios=(4,), max_model_len=64, max_ngram_size=3,
                        image_token_id=5, ngram_lookup=torch.arange(20, dtype=torch.int32) + 100)


def _engram_prompt() -> NamedCase:
    # seq0 tokens [1, 2, 5, 3, 4, 6], image at pos 2, compressed history [41] (covers t = 0).
    #   pos 2: t=2 is the image -> all pad. pos 3: t=3 -> lookup[3] = 103, t<=2 crosses the image.
    #   pos 5: 106, 104, 103.
    # seq1 tokens [7, 8, 9], history [50, 51]: pos 2: t=2 -> lookup[9] = 109, then 51, 50.
    seqs = [SequenceMetadata(4, 6, [1], 0, [1, 2, 5, 3, 4, 6], compressed_token_ids=[41]),
            SequenceMetadata(3, 3, [2], 1, [7, 8, 9], compressed_token_ids=[50, 51])]
    return NamedCase("engram_image_prompt", ENGRAM, seqs, True, {
        "ngram_token_ids": [[0, 0, 0], [103, 0, 0], [104, 103, 0], [106, 104, 103],
                            [50, 0, 0], [51, 50, 0], [109, 51, 50]],
        "input_ids": [5, 3, 4, 6, 7, 8, 9],
    })


def _engram_decode() -> NamedCase:
    # No lookup table (identity), pad 1000. Tokens [1, 5, 3, 4] (image at pos 1), draft [9].
    #   pos 3: 4, 3, then t=1 is the image -> pad. pos 4 reads the draft: 9, 4, 3.
    # seq1: the draft itself is the image: pos 2 -> all pad; pos 1: 2, 1.
    cfg = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(4,), max_model_len=64, max_ngram_size=3,
                         ngram_pad_token=1000, image_token_id=5)
    seqs = [SequenceMetadata(2, 5, [1], 0, [1, 5, 3, 4], draft_tokens=[9]),
            SequenceMetadata(2, 3, [2], 1, [1, 2], draft_tokens=[5])]
    return NamedCase("engram_image_decode", cfg, seqs, False, {
        "ngram_token_ids": [[4, 3, 1000], [9, 4, 3], [2, 1, 1000], [1000, 1000, 1000]],
        "input_ids": [4, 9, 2, 5],
    })


# bs=8, W=2, S=2, dense (1,), sparse (): max_num_blocks = cdiv(32, 8) = 4, width_1 = 128.
DENSE1 = MetadataConfig(block_size=8, window_size=2, swa_block_size=2, dense_compress_ratios=(1,),
                        sparse_compress_ratios=(), max_model_len=32)


def _dense1_prompt() -> NamedCase:
    # q_start 3, rows pos 3, 4: ratio 1 writes c = 3, 4 -> slots 6*8 + 3, 6*8 + 4.
    return NamedCase("dense1_sparse_none_prompt", DENSE1, [_seq(2, 5, [6], 0)], True, {
        "ks": {}, "ke": {},
        "positions_c.1": [3, 4],
        "slot_mapping_store_ca.1": [51, 52],
        "cu_compressed_seqlens_k.1": [0, 5],
        "load_segments_ca.1": [[6, 0, 5, 0]],
        "kv_ca_index_offset_len.1": [[0, 4], [0, 5]],
        "kv_ca_index.1[0]": [0, 1, 2, 3] + [-1] * 124,
    })


def _dense1_decode() -> NamedCase:
    # pos 9: p = 0..9 -> blocks 6 (p < 8) then 2: 48..55, 16, 17. SWA: w 2, start 0 -> [6, 7].
    return NamedCase("dense1_sparse_none_decode", DENSE1, [_dec(1, 10, [6, 2], 3)], False, {
        "klen": {},
        "positions_c.1": [9],
        "slot_mapping_store_ca.1": [17],
        "kv_ca_index_offset_len.1": [[0, 10]],
        "kv_ca_index.1[0]": list(range(48, 56)) + [16, 17] + [-1] * 118,
        "kv_swa_index_offset_len": [[6, 2]],
        "kv_swa_index": [[6, 7]],
        "block_tables": [[6, 2]],
    })


# bs=128, W=8, S=8, dense (4, 128), sparse (4,): b_c = 32 (ratio 4) and 1 (ratio 128).
R4_128 = MetadataConfig(block_size=128, window_size=8, swa_block_size=8, dense_compress_ratios=(4, 128),
                        sparse_compress_ratios=(4,), max_model_len=512)


def _dense_4_128_prompt() -> NamedCase:
    # seq0 k=2 (nothing loaded: zero row). seq1 q_start 250, k 260, blocks [21, 22, 23].
    # ratio 4: m = 65 -> [21,0,32,1], [22,0,32,33], [23,0,1,65]; writes c = 62, 63, 64 ->
    #   slots 22*32 + 30, 22*32 + 31, 23*32 + 0. ratio 128: m = 2 -> [21,0,1,1], [22,0,1,2];
    #   writes c = 1 -> slot 22. ke (ratio 4) = 1 + (pos+1)//4.
    # SWA seq1: hist [242, 250), slots 2..7 | 0, 1 -> [1,2,8,8], [1,0,2,14]; writes only
    #   j >= 10 - 8 = 2.
    seqs = [_seq(2, 2, [30], 0), _seq(10, 260, [21, 22, 23], 1)]
    return NamedCase("dense_4_128_sparse_4_prompt", R4_128, seqs, True, {
        "seq_block_tables": [[30, -1, -1], [21, 22, 23]],  # width 3 = longest table, -1 padded
        "cu_compressed_seqlens_k.4": [0, 1, 66],
        "cu_compressed_seqlens_k.128": [0, 1, 3],
        "load_segments_ca.4": [[-1, 0, 1, 0], [21, 0, 32, 1], [22, 0, 32, 33], [23, 0, 1, 65]],
        "load_segments_ca.128": [[-1, 0, 1, 0], [21, 0, 1, 1], [22, 0, 1, 2]],
        "total_k_compressed": {"4": 66, "128": 3},
        "positions_c.4": [0, 248, 252, 256],
        "slot_mapping_store_ca.4": [-1, 734, 735, 736],
        "cu_compressed_seqlens_q.4": [0, 1, 4],
        "positions_c.128": [0, 128],
        "slot_mapping_store_ca.128": [-1, 22],
        "ks.4": [0, 0] + [1] * 10,
        "ke.4": [0, 0, 63, 64, 64, 64, 64, 65, 65, 65, 65, 66],
        "kv_ca_index_offset_len.128": [[0, 0], [0, 0]] + [[1, 1]] * 5 + [[1, 2]] * 5,
        "load_segments_swa": [[-1, 0, 8, 0], [1, 2, 8, 8], [1, 0, 2, 14]],
        "slot_mapping_store_swa": [0, 1, -1, -1, 12, 13, 14, 15, 8, 9, 10, 11],
    })


def _dense_4_128_decode() -> NamedCase:
    # block_tables width: 2 blocks rounded up to 16, at most max_num_blocks = cdiv(512//4, 128//4) = 4.
    # Rows: pos 255 (seq0), pos 127, 128 (seq1).
    # ratio 128: pos 255 completes c=1 -> slot 22; pos 127 completes c=0 -> slot 40.
    # ratio 4: pos 255 -> c=63, slot 22*32 + 31 = 735; pos 127 -> c=31, 40*32 + 31 = 1311.
    # kv_ca ratio 128 row 0: offset 0, len 2 -> [21, 22]; row 2: offset 2*4 -> block row 2 col 0 = 40.
    seqs = [_dec(1, 256, [21, 22], 0), _dec(2, 129, [40, 41], 1)]
    return NamedCase("dense_4_128_sparse_4_decode", R4_128, seqs, False, {
        "positions": [255, 127, 128],
        "positions_c.128": [128, 0, 0],
        "slot_mapping_store_ca.128": [22, 40, -1],
        "positions_c.4": [252, 124, 0],
        "slot_mapping_store_ca.4": [735, 1311, -1],
        "kv_ca_index_offset_len.128": [[0, 2], [4, 1], [8, 1]],
        "kv_ca_index_offset_len.4": [[0, 64], [128, 32], [256, 32]],
        "kv_ca_index.128[0]": [21, 22] + [-1] * 126,
        "kv_ca_index.128[2]": [40] + [-1] * 127,
        "kv_ca_index.4[0]": [21 * 32 + p for p in range(32)] + [22 * 32 + p for p in range(32)] + [-1] * 64,
        "block_tables": [[21, 22], [40], [40]],
        "klen.4": [64, 32, 32],
    })


SPARSE_ONLY = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(),
                             sparse_compress_ratios=(4,), max_model_len=64)
DENSE_ONLY = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                            sparse_compress_ratios=(), max_model_len=64)


def _ratio_set_cases() -> list[NamedCase]:
    # An empty ratio set gives an EMPTY dict on the path where the field applies.
    return [
        NamedCase("dense_none_sparse_4_prompt", SPARSE_ONLY, [_seq(3, 9, [1], 0)], True, {
            "kv_ca_index_offset_len": {}, "kv_ca_index": {}, "kv_ca_index_len": {},
            "ks.4": [0, 0, 0], "ke.4": [1, 2, 2],  # rows pos 6, 7, 8: ke = (pos+1)//4
        }),
        NamedCase("dense_4_sparse_none_prompt", DENSE_ONLY, [_seq(3, 9, [1], 0)], True, {
            "ks": {}, "ke": {}, "kv_ca_index_offset_len.4": [[0, 1], [0, 2], [0, 2]],
        }),
        NamedCase("dense_none_sparse_4_decode", SPARSE_ONLY, [_dec(2, 9, [1, 2], 0)], False, {
            "kv_ca_index_offset_len": {}, "kv_ca_index": {}, "klen.4": [2, 2],
        }),
        NamedCase("dense_4_sparse_none_decode", DENSE_ONLY, [_dec(1, 9, [1, 2], 0)], False, {
            "klen": {}, "kv_ca_index_offset_len.4": [[0, 2]], "kv_ca_index.4[0]": [4, 5] + [-1] * 126,
        }),
    ]


def _tiny_max_model_len() -> NamedCase:
    # max_model_len 64 < min ratio 128: no row needs a block (max_num_blocks = cdiv(64 // 128, 1) = 0) and
    # width_128 = 0. Every offset is i * 0 * 1 = 0 and every length (pos+1)//128 = 0, so
    # block_tables is [2, 0] and the expanded kv_ca_index rows are empty.
    cfg = MetadataConfig(block_size=128, window_size=4, swa_block_size=4, dense_compress_ratios=(128,),
                         sparse_compress_ratios=(), max_model_len=64)
    return NamedCase("max_model_len_below_ratio_decode", cfg, [_dec(2, 64, [], 0)], False, {
        "kv_ca_index_offset_len.128": [[0, 0], [0, 0]],
        "kv_ca_index.128": [[], []],
        "block_tables": [[], []],
        "positions_c.128": [0, 0],
    })


# A plain paged-KV model (docs/design.md section 14): no ratios, no sliding window. A block holds 16 tokens, so
# a 17-token sequence needs cdiv(17, 16) = 2 blocks and decode tables have cdiv(64, 16) = 4 columns.
PLAIN = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                       max_model_len=64)
# KV sharded over 3 ranks, interleave 1: rank 0 holds positions 0, 3, 6, ...: of 300 keys, 100 ->
# cdiv(100, 16) = 7 blocks per table, and decode tables have 7 columns (blocks_needed(300)).
PLAIN_KV3 = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                           max_model_len=300, kv_cp_world_size=3)
# Each feature alone: compressed KV without a sliding window, a sliding window without compressed KV.
CA_NO_SWA = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(4,), sparse_compress_ratios=(4,),
                           max_model_len=64)
SWA_NO_CA = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(),
                           sparse_compress_ratios=(), max_model_len=64)
_NO_CA = dict.fromkeys(("positions_c", "slot_mapping_store_ca", "klen", "ks", "ke", "kv_ca_index_offset_len",
                        "kv_ca_index", "kv_ca_index_len", "cu_compressed_seqlens_q", "cu_compressed_seqlens_k",
                        "load_segments_ca", "total_k_compressed"))
_NO_SWA = dict.fromkeys(("slot_mapping_store_swa", "state_block_idx", "total_k_swa", "load_segments_swa",
                         "kv_swa_full_index_pivots", "kv_swa_full_index", "kv_swa_index_offset_len",
                         "kv_swa_index"))


def _plain_cases() -> list[NamedCase]:
    # every compressed and sliding-window field is None (the dict entries map it to None)
    return [
        NamedCase("plain_prompt", PLAIN, [_seq(17, 17, [7, 3], 2)], True, {
            **_NO_CA, **_NO_SWA, "positions": list(range(17)), "seq_block_tables": [[7, 3]],
            "cu_seqlens_k": [0, 17],
        }),
        # rows at positions 15, 16; tables cut to their 2 defined columns of 4
        NamedCase("plain_decode", PLAIN, [_dec(2, 17, [7, 3], 2), _dec(1, 5, [4, 9, 1], 0)], False, {
            **_NO_CA, **_NO_SWA, "positions": [15, 16, 4], "context_lens": [16, 17, 5],
            "block_tables": [[7, 3], [7, 3], [4]], "input_ids": [115, 900, 104],
        }),
        NamedCase("plain_kv_sharded_decode", PLAIN_KV3, [_dec(1, 300, list(range(10, 17)), 0)], False, {
            **_NO_CA, **_NO_SWA, "context_lens": [300], "block_tables": [list(range(10, 17))],
        }),
        # ratio 4, rows pos 6..8: c in [1, 2) -> positions_c 4, slot 1 * 4 + 1 = 5
        NamedCase("compressed_no_swa_prompt", CA_NO_SWA, [_seq(3, 9, [1], 0)], True, {
            **_NO_SWA, "positions_c.4": [4], "slot_mapping_store_ca.4": [5], "ke.4": [1, 2, 2],
        }),
        # S = 6, state 1: rows pos 6..8 -> slots 6 + 0, 6 + 1, 6 + 2
        NamedCase("swa_no_compressed_prompt", SWA_NO_CA, [_seq(3, 9, [1], 1)], True, {
            **_NO_CA, "slot_mapping_store_swa": [6, 7, 8], "total_k_swa": 4, "state_block_idx": [1],
        }),
    ]


NAMED_CASES: list[NamedCase] = [
    _first_chunk(), _chunk_lt_w(), _chunk_gt_w(), _ring_wrap(), _seqlen_k_lt_r(), _swa_valid_start(),
    _placeholder_prompt(), _placeholder_decode(), _mtp_drafts(), _engram_prompt(), _engram_decode(),
    _dense1_prompt(), _dense1_decode(), _dense_4_128_prompt(), _dense_4_128_decode(),
    *_ratio_set_cases(), _tiny_max_model_len(), *_plain_cases(),
]
