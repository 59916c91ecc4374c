"""The in-place decode path's compiled staging writers (``cpmeta/gpu/staging_njit.py``) against the
per-token reference (``tests/reference.py``), and their error messages.

- hypothesis random decode batches (``strategies.decode_cases``: drafts, placeholders, Engram with
  and without ``ngram_lookup`` and an image sentinel, plain and KV-sharded configs), staged by
  ``DecodeStaging.fill`` (``stage_batch``) and, holding the same requests in a ``BatchState``, by
  ``stage_decode`` (``stage_state``; Engram through its fallback): the buffer read back with
  ``StagingLayout.unpack`` is what ``ref_prepare_decode`` says -- sizes, ratio words, the
  per-sequence rows, every row's input id, each sequence's defined block ids, and the Engram windows
  expanded by the kernels' read rule equal ``ngram_token_ids``;
- every error names the field and the sequence, with ``prepare_decode``'s exact message.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from cpmeta import BatchState, MetadataConfig, SequenceBatch, SequenceMetadata, prepare_decode
from cpmeta.config import blocks_needed
from cpmeta.gpu.decode_staging import DecodeStaging, stage_decode
from cpmeta.gpu.staging_layout import StagedDecode, StagingLayout, unpack_staging
from reference import ref_prepare_decode
from strategies import decode_cases

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _window_rows(vals: np.ndarray, bars: np.ndarray, seqs: list[SequenceMetadata], cfg: MetadataConfig) -> list:
    """``ngram_token_ids`` as the kernels read the staged windows: column c of row j of a sequence
    is its window element ``i = G - 1 + j - c``, the pad id when a barrier lies in ``[i, G - 1 + j]``."""
    G, rows, w0 = cfg.max_ngram_size, [], 0
    for seq in seqs:
        for j in range(seq.seqlen_q):
            rows.append([cfg.ngram_pad_token if bars[w0 + G - 1 + j - c:w0 + G + j].any()
                         else int(vals[w0 + G - 1 + j - c]) for c in range(G)])
        w0 += seq.seqlen_q + G - 1
    return rows


def assert_staged_is_reference(stg: DecodeStaging, staged: StagedDecode, seqs: list[SequenceMetadata],
                               cfg: MetadataConfig) -> None:
    """The staged batch, read back (``unpack_staging``), against ``ref_prepare_decode(seqs)``."""
    ref = ref_prepare_decode(seqs, cfg)
    got: dict[str, Any] = unpack_staging(stg.host_buffer[:staged.used].numpy(), staged, cfg)
    n, tq, cu_q, cu_k = len(seqs), ref["total_q"], ref["cu_seqlens_q"], ref["cu_seqlens_k"]
    ca = sorted(set(cfg.dense_compress_ratios) | set(cfg.sparse_compress_ratios))
    words = [*ca, *cfg.sparse_compress_ratios, *cfg.dense_compress_ratios]
    tables = [ref["block_tables"][row] for row in cu_q[:-1]]  # a sequence's defined ids, on each of its rows
    scalars = StagedDecode(n, tq, cu_k[-1], ref["max_seqlen_q"], ref["max_seqlen_k"], 0, max(map(len, tables)))
    assert got["sizes"] == ([n, tq, cu_k[-1], 8 + len(words), 8 + len(words) + 7 * n], words, scalars)
    assert got["seq"].tolist() == [[s.seqlen_q for s in seqs], [s.seqlen_k for s in seqs], cu_q[1:], cu_k[1:],
                                   [s.state_id for s in seqs], [int(s.is_placeholder) for s in seqs]]
    assert got["ids"].tolist() == ref["input_ids"]
    assert [t.tolist() for t in got["tables"]] == tables
    vals, bars = got["ngram"]
    if cfg.max_ngram_size:
        assert len(vals) == len(bars) == tq + n * (cfg.max_ngram_size - 1)
        assert _window_rows(vals, bars, seqs, cfg) == ref["ngram_token_ids"]
    else:
        assert len(vals) == len(bars) == 0 and ref["ngram_token_ids"] is None


def _placeholder(cfg: MetadataConfig) -> SequenceMetadata:
    """What ``BatchState.decode_batch(num_placeholders=...)`` appends: one row at position 0, state
    0, input id 0, ``blocks_needed(1)`` zero block ids."""
    return SequenceMetadata(seqlen_q=1, seqlen_k=1, block_table=[0] * blocks_needed(1, cfg), state_id=0,
                            token_ids=[0], is_placeholder=True)


@SETTINGS
@given(case=decode_cases(n_seqs=None, max_drafts=3))
def test_staged_batch_reads_back_as_the_reference(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    cfg, seqs = case
    stg = DecodeStaging("cpu", 8)  # tiny: the writer's BufferError grows it
    assert_staged_is_reference(stg, stg.fill(seqs, cfg), seqs, cfg)
    sb = SequenceBatch.from_sequences(seqs, cfg, is_prompt=False)
    stg.host_buffer.fill_(-7)  # the array form, over junk: every word of [0, used) rewritten
    assert_staged_is_reference(stg, stg.fill(sb, cfg), seqs, cfg)


@SETTINGS
@given(case=decode_cases(n_seqs=None, max_drafts=3, placeholders=False), n_ph=hst.integers(0, 3))
def test_state_staged_step_reads_back_as_the_reference(case: tuple[MetadataConfig, list[SequenceMetadata]],
                                                       n_ph: int) -> None:
    """The same requests held in a ``BatchState``: ``stage_decode`` (the fixed-stride writer; an
    Engram config through the fallback) stages what the reference says of them plus ``n_ph``
    placeholders."""
    cfg, seqs = case
    st = BatchState(cfg, max_seqs=len(seqs), max_blocks=max(1, *(len(s.block_table) for s in seqs)))
    slots = np.array([st.add_request(i, list(s.token_ids), list(s.block_table), s.state_id,
                                     compressed_token_ids=list(s.compressed_token_ids),
                                     swa_valid_start=s.swa_valid_start, num_computed=len(s.token_ids))
                      for i, s in enumerate(seqs)], np.int64)
    drafts = np.array([d for s in seqs for d in s.draft_tokens], np.int64)
    counts = np.array([s.seqlen_q - 1 for s in seqs])
    stg = DecodeStaging("cpu", 8)
    staged = stage_decode(stg, st, slots, drafts, counts, num_placeholders=n_ph)
    assert_staged_is_reference(stg, staged, seqs + [_placeholder(cfg)] * n_ph, cfg)


# ---- errors: the field and the sequence, prepare_decode's words --------------------------------------

CFG = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                     sparse_compress_ratios=(4, 8), max_model_len=96)
ENGRAM = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                        sparse_compress_ratios=(4, 8), max_model_len=96, max_ngram_size=3, image_token_id=5,
                        ngram_lookup=torch.arange(97, dtype=torch.int64) + 100)
HUGE = MetadataConfig(block_size=2**20, window_size=4, swa_block_size=8, dense_compress_ratios=(4,),
                      sparse_compress_ratios=(), max_model_len=2**29)


def _seqs(cfg: MetadataConfig, tables: list[list[int]], at: Optional[dict[int, int]] = None,
          compressed: tuple[int, ...] = ()) -> list[SequenceMetadata]:
    """One decode sequence per table: 20 confirmed tokens ``10 + position`` (``at``: other tokens at
    some positions), one draft, state s: ``seqlen_k`` 21, rows at positions 19 and 20, 2 blocks of
    16 needed. With G = 3 a sequence's Engram window is positions 17..20."""
    toks = [(at or {}).get(p, 10 + p) for p in range(20)]
    return [SequenceMetadata(seqlen_q=2, seqlen_k=21, block_table=t, state_id=s, token_ids=toks, draft_tokens=[9],
                             compressed_token_ids=list(compressed)) for s, t in enumerate(tables)]


def _huge(sk: list[int], sq: int = 1) -> SequenceBatch:
    """A decode batch of ``HUGE``'s from arrays (``seqlen_k`` up to 2**29 without its tokens)."""
    n = len(sk)
    k = np.array(sk, np.int64)
    q = np.full(n, sq, np.int64)
    nb = [blocks_needed(int(v), HUGE) for v in sk]
    off = np.zeros(n + 1, np.int64)
    off[1:] = np.cumsum(nb)
    return SequenceBatch(False, q, k, np.arange(n, dtype=np.int64), np.zeros(n, np.int64), np.zeros(n, bool),
                         k - q + 1, np.arange(int(off[-1]), dtype=np.int64) % 500, off, np.ones(n * sq, np.int64),
                         np.arange(n + 1, dtype=np.int64) * sq, np.zeros(0, np.int64), np.zeros(n + 1, np.int64), 0)


ERRORS: dict[str, tuple[MetadataConfig, Callable[[], "list[SequenceMetadata] | SequenceBatch"], str]] = {
    "negative block id": (CFG, lambda: _seqs(CFG, [[3, 7], [4, -3]]),
                          re.escape("seqs[1].block_table: expected block ids >= 0, got -3 at index 1")),
    "block id past int32 slots": (CFG, lambda: _seqs(CFG, [[3, 7], [4, 6], [5, CFG.max_block_id + 1]]),
                                  re.escape(f"seqs[2].block_table: expected block ids <= {CFG.max_block_id}, "
                                            f"got {CFG.max_block_id + 1} at index 1 (slot_mapping_store_ca int32")),
    "sum(seqlen_k)": (HUGE, lambda: _huge([2**29] * 5), r"^cu_seqlens_k: int32 overflow, sum\(seqlen_k\) = 2684354560"),
    "kv_ca offsets": (HUGE, lambda: _huge([9] * 4, sq=4), r"^kv_ca_index_offset_len: int32 overflow, total_q \(16\)"),
    "token outside ngram_lookup": (ENGRAM, lambda: _seqs(ENGRAM, [[3, 7]]) + _seqs(ENGRAM, [[], [4, 6]],
                                                                                at={18: 500})[1:],
                                   r"^ngram_lookup: a token id of seqs\[1\] read by ngram_token_ids is outside the "
                                   r"table \(97 entries\)$"),
    "compressed id past int32": (ENGRAM, lambda: _seqs(ENGRAM, [[3, 7]]) + _seqs(ENGRAM, [[], [4, 6]],
                                                                              compressed=(1,) * 17 + (2**31,))[1:],
                                 r"^ngram_token_ids: an id of seqs\[1\] does not fit in int32 \(an ngram_lookup "
                                 r"entry or a compressed token id\)$"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_field_and_sequence_as_prepare_decode(name: str) -> None:
    cfg, make, pattern = ERRORS[name]
    with pytest.raises(ValueError, match=pattern) as built:
        prepare_decode(make(), cfg)
    stg = DecodeStaging("cpu", 4096)
    stg.host_buffer.fill_(-7)
    with pytest.raises(ValueError) as staged:
        stg.fill(make(), cfg)
    assert str(staged.value) == str(built.value)
    assert (stg.host_buffer == -7).all()  # every check before the first write


def test_unread_words_raise_nothing_and_a_short_fixed_buffer_names_its_need() -> None:
    """A token outside ``ngram_lookup`` (or a compressed id past int32) that every row reads padded
    -- behind the image sentinel -- is no error, as in ``prepare_decode``; a fixed staging buffer
    too small names the elements the batch needs."""
    # the windows, positions 17..20: (500 | a compressed id 2**31), the image sentinel, 29, draft 9:
    # every read of position 17 crosses the sentinel at 18; the third: 27, 500, the sentinel at the
    # first row's own position 19, draft 9
    seqs = [_seqs(ENGRAM, [[3, 7]], at={17: 500, 18: 5})[0],
            _seqs(ENGRAM, [[3, 7], [4, 6]], at={18: 5}, compressed=(1,) * 17 + (2**31,))[1],
            _seqs(ENGRAM, [[3, 7], [4, 6], [8, 2]], at={18: 500, 19: 5})[2]]
    prepare_decode(seqs, ENGRAM)  # no error there either
    stg = DecodeStaging("cpu", 8)
    assert_staged_is_reference(stg, stg.fill(seqs, ENGRAM), seqs, ENGRAM)
    need = stg.fill(seqs, ENGRAM).used
    with pytest.raises(ValueError, match=re.escape(f"seqs: batch needs {need} staging elements, the fixed staging "
                                                   f"buffer holds {need - 1}")):
        DecodeStaging("cpu", need - 1, fixed=True).fill(seqs, ENGRAM)


def test_layout_write_batch_without_a_report_and_too_short_a_view() -> None:
    """``StagingLayout.write_batch(view, batch)`` alone: its own scratch; a short view is a
    ``BufferError`` carrying the elements needed, nothing written."""
    layout = StagingLayout.of(CFG)
    sb = SequenceBatch.from_sequences(_seqs(CFG, [[3, 7], [4, 6]]), CFG, is_prompt=False)
    view = np.full(1000, -7, np.int32)
    staged = layout.write_batch(view, sb)
    short = np.full(staged.used - 1, -7, np.int32)
    with pytest.raises(BufferError) as e:
        layout.write_batch(short, sb)
    assert e.value.args == (staged.used,) and (short == -7).all()


def test_configs_equal_but_for_their_ngram_table_stage_their_own() -> None:
    """``MetadataConfig`` compares without ``ngram_lookup`` (a tensor: ``compare=False``), so two
    configs that differ only in their table are EQUAL. The per-config memos (``StagingLayout.of``,
    the builders' plans: ``cpmeta.cache.IdentityCache``) are keyed by the config object, not by
    equality: a memo keyed by ``==`` would hand the second config the first one's layout, whose
    writer reads the first table. Each config's staged windows must be its own reference."""
    other = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                           sparse_compress_ratios=(4, 8), max_model_len=96, max_ngram_size=3, image_token_id=5,
                           ngram_lookup=torch.arange(97, dtype=torch.int64) + 300)
    assert other == ENGRAM and other.ngram_lookup is not ENGRAM.ngram_lookup
    seqs = _seqs(ENGRAM, [[3, 7], [4, 6]])
    got = []
    for cfg in (ENGRAM, other, ENGRAM):
        stg = DecodeStaging("cpu", 8)
        staged = stg.fill(seqs, cfg)
        assert_staged_is_reference(stg, staged, seqs, cfg)
        got.append(prepare_decode(seqs, cfg).ngram_token_ids.tolist())
    assert got[0] == got[2] != got[1]  # the tables differ, and so do the builds' Engram ids
