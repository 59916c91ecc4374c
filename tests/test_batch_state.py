"""``BatchState`` (DESIGN 13): a seeded random engine drives it for hundreds of steps; every step's
``SequenceBatch`` must build the same metadata as a list of ``SequenceMetadata`` rebuilt from a
plain Python mirror of the requests. Capacity errors name the request and leave the state usable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from cpmeta import BatchState, MetadataConfig, SequenceBatch, SequenceMetadata, prepare_decode, prepare_prompt
from cpmeta.diff import metadata_diff
from cpmeta.sequence import blocks_needed
from cpmeta.state.vouched import StateDecodeBatch

CFG = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                     sparse_compress_ratios=(4, 8), max_model_len=96, max_ngram_size=3, image_token_id=5)
#: no Engram: decode steps take BatchState's fast path (cpmeta/state/decode_fast.py)
PLAIN = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                       sparse_compress_ratios=(4, 8), max_model_len=96)
#: a plain paged-KV model (DESIGN 14: no ratios, no sliding window), and its KV sharded over 3
#: ranks in runs of 4 (tables of rank 0's share)
PAGED = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                       max_model_len=96)
PAGED_KV3 = MetadataConfig(block_size=8, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                           max_model_len=200, kv_cp_world_size=3, kv_cp_interleave=4)
YOCO = MetadataConfig(block_size=16, window_size=4, swa_block_size=8, dense_compress_ratios=(4,),
                      sparse_compress_ratios=(4,), max_model_len=96, yoco_keep_tokens=6)


@dataclass
class _Req:
    """The plain mirror of one request."""

    slot: int
    tokens: list[int]
    prompt_len: int
    blocks: list[int]
    state: int
    valid_start: int
    comp: list[int]
    done: int = 0
    drafts: list[int] = field(default_factory=list)


def _grow(st: BatchState, r: _Req, k: int, cfg: MetadataConfig, rng: random.Random) -> None:
    need = blocks_needed(k, cfg)
    if need > len(r.blocks):
        new = [rng.randrange(1000) for _ in range(need - len(r.blocks) + rng.choice((0, 1)))]
        new = new[: st.max_blocks - len(r.blocks)]
        st.append_blocks(r.slot, new)
        r.blocks += new


def _rows(batch, cfg: MetadataConfig):
    """The 2-D padded table a batch is vouched to carry (``Vouch.block_rows32``), or None."""
    v = batch.vouch_for(cfg)
    return None if v is None else v.block_rows32


def _assert_bt2d(batch, cfg: MetadataConfig) -> None:
    """The 2-D padded table a decode batch carries (``Vouch.block_rows32``) equals its flat tables."""
    rows = _rows(batch, cfg)
    if rows is None:
        return
    assert not rows.flags.writeable
    want = np.full((len(batch), cfg.max_num_blocks), -1, np.int32)
    off = batch.block_table_offsets
    for s in range(len(batch)):
        row = batch.block_tables[off[s]:off[s + 1]][: cfg.max_num_blocks]
        want[s, : len(row)] = row
    np.testing.assert_array_equal(rows, want)


def _assert_same_batch(batch: StateDecodeBatch, st: BatchState, sel: list[_Req]) -> None:
    """The fast path's batch equals the general path's (``BatchState._batch``) array by array,
    the lazily made flat tables included."""
    slots = np.array([r.slot for r in sel])
    nd = np.array([len(r.drafts) for r in sel], np.int64)
    want = st._batch(False, slots, 1 + nd, st.num_tokens[slots] + nd,
                     np.array([t for r in sel for t in r.drafts], np.int64), 0)
    for name in ("seqlen_q", "seqlen_k", "state_id", "swa_valid_start", "is_placeholder", "num_tokens",
                 "block_tables", "block_table_offsets", "tokens", "token_offsets", "compressed",
                 "compressed_offsets"):
        a, b = getattr(batch, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert batch.lookback == want.lookback and batch.is_prompt is False
    np.testing.assert_array_equal(_rows(batch, st.cfg), _rows(want, st.cfg))


def _free_state(rng: random.Random, reqs: dict[int, _Req]) -> int:
    """A state id in [0, 50) no live request holds (the state cache refuses a shared one)."""
    return rng.choice(sorted(set(range(50)) - {r.state for r in reqs.values()}))


def _run(cfg: MetadataConfig, seed: int, steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    st = BatchState(cfg, max_seqs=6, max_tokens=cfg.max_model_len)
    reqs: dict[int, _Req] = {}
    seen = {"prompt": 0, "decode": 0, "errors": 0, "finished": 0, "fast": 0}
    next_id = 0
    for _ in range(steps):
        if rng.random() < 0.4:  # joins (some beyond max_seqs: refused, state unchanged)
            n = rng.randint(1, 60)
            toks = [rng.randrange(8) for _ in range(n)]
            comp = [rng.randrange(100, 200) for _ in range(rng.randint(0, n))] if cfg.max_ngram_size else []
            blocks = [rng.randrange(1000) for _ in range(blocks_needed(n, cfg))]
            next_id += 1
            kw = dict(compressed_token_ids=comp, swa_valid_start=rng.choice((0, 0, rng.randrange(n))))
            if len(reqs) == st.max_seqs:
                with pytest.raises(ValueError, match=f"request {next_id}: all max_seqs=6 slots"):
                    st.add_request(next_id, toks, blocks, 0, **kw)
                seen["errors"] += 1
            else:
                state = _free_state(rng, reqs)
                s = st.add_request(next_id, toks, blocks, state, **kw)
                reqs[s] = _Req(s, toks, n, blocks, state, kw["swa_valid_start"], comp)
        if rng.random() < 0.15 and reqs:  # a finish, or a moved state id
            r = reqs[rng.choice(sorted(reqs))]
            if rng.random() < 0.5:
                st.finish(r.slot)
                del reqs[r.slot]
                seen["finished"] += 1
            else:
                r.state = _free_state(rng, reqs)
                st.set_state_id(r.slot, r.state)
        pre = [r for r in reqs.values() if r.done < r.prompt_len]
        dec = [r for r in reqs.values() if r.done >= r.prompt_len and len(r.tokens) < cfg.max_model_len - 2]
        n_ph = rng.choice((0, 0, 0, 1, 2))
        if pre and (rng.random() < 0.5 or not dec):
            sel = rng.sample(pre, rng.randint(1, len(pre)))
            lens = [rng.randint(1, r.prompt_len - r.done) for r in sel]
            seqs = [SequenceMetadata(q, r.done + q, list(r.blocks), r.state, list(r.tokens),
                                     swa_valid_start=r.valid_start, compressed_token_ids=list(r.comp))
                    for r, q in zip(sel, lens)]
            seqs += [SequenceMetadata(1, 1, [0] * blocks_needed(1, cfg), 0, [0], is_placeholder=True)] * n_ph
            batch = st.prompt_batch(np.array([r.slot for r in sel]), np.array(lens), num_placeholders=n_ph)
            assert metadata_diff(prepare_prompt(batch, cfg), prepare_prompt(seqs, cfg), cfg=cfg) == []
            for r, q in zip(sel, lens):
                r.done += q
                if r.done == r.prompt_len:
                    tok = rng.randrange(8)
                    st.append_tokens(r.slot, [tok])
                    r.tokens.append(tok)
            seen["prompt"] += 1
        elif dec and cfg.yoco_keep_tokens is None:
            sel = rng.sample(dec, rng.randint(1, len(dec)))
            for r in sel:
                r.drafts = [rng.randrange(8) for _ in range(rng.choice((0, 1, 2)))]
                _grow(st, r, len(r.tokens) + len(r.drafts), cfg, rng)
            seqs = [SequenceMetadata(1 + len(r.drafts), len(r.tokens) + len(r.drafts), list(r.blocks), r.state,
                                     list(r.tokens), swa_valid_start=r.valid_start, draft_tokens=list(r.drafts),
                                     compressed_token_ids=list(r.comp)) for r in sel]
            seqs += [SequenceMetadata(1, 1, [0] * blocks_needed(1, cfg), 0, [0], is_placeholder=True)] * n_ph
            batch = st.decode_batch(np.array([r.slot for r in sel]), np.array([t for r in sel for t in r.drafts]),
                                    np.array([len(r.drafts) for r in sel]), num_placeholders=n_ph)
            _assert_bt2d(batch, cfg)
            if isinstance(batch, StateDecodeBatch):
                seen["fast"] += 1
                ends = batch.block_table_ends()  # from the 2-D rows, before the flat tables exist
                _assert_same_batch(batch, st, sel)
                flat = SequenceBatch.block_table_ends(batch)  # from the flat tables
                assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(ends, flat)), (ends, flat)
            assert metadata_diff(prepare_decode(batch, cfg), prepare_decode(seqs, cfg), cfg=cfg) == []
            acc = [r.drafts[: rng.randint(0, len(r.drafts))] + [rng.randrange(8)] for r in sel]
            st.append_tokens_batch(np.array([r.slot for r in sel]), np.array([t for a in acc for t in a]),
                                   np.array([len(a) for a in acc]))
            for r, a in zip(sel, acc):
                r.tokens += a
            seen["decode"] += 1
    return seen


@pytest.mark.parametrize("seed", [0])
def test_random_engine_matches_lists(seed: int) -> None:
    seen = _run(CFG, seed, 250)
    assert seen["prompt"] > 30 and seen["decode"] > 30 and seen["finished"] > 5 and seen["errors"] > 0, seen
    assert seen["fast"] == 0  # Engram: the general path


@pytest.mark.parametrize("cfg", [PAGED, PAGED_KV3], ids=["plain", "plain_kv_sharded"])
def test_random_engine_plain_config_matches_lists(cfg: MetadataConfig) -> None:
    """A plain paged-KV config (its KV sharded too): the state's batches build what the lists do,
    decode through the fast path, with tables of ``blocks_needed`` blocks."""
    seen = _run(cfg, 3, 200)
    assert seen["prompt"] > 20 and seen["decode"] > 20 and seen["fast"] > 10, seen


@pytest.mark.parametrize("seed", [1, 2])
def test_random_engine_fast_decode_matches_lists(seed: int) -> None:
    """Without Engram the decode steps without placeholders take the fast path; every batch it
    makes equals the general path's and builds the list path's metadata."""
    seen = _run(PLAIN, seed, 250)
    assert seen["decode"] > 30 and seen["fast"] > 15 and seen["finished"] > 5, seen


def test_table_cap_is_the_largest_covered_seqlen() -> None:
    """``_table_cap`` (behind ``_dec_cap``: one gather replaces blocks_needed per step) equals a
    brute-force search."""
    sharded = [MetadataConfig(block_size=bs, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                              max_model_len=mml, kv_cp_world_size=w, kv_cp_interleave=i)
               for bs, mml, w, i in ((16, 300, 3, 1), (8, 200, 3, 4), (8, 97, 2, 8), (4, 50, 4, 2), (16, 64, 1, 4))]
    for cfg in (PLAIN, CFG, PAGED, *sharded,
                MetadataConfig.compressed_swa(block_size=32, dense_compress_ratios=(4, 32), sparse_compress_ratios=(8,),
                               max_model_len=200)):
        st = BatchState(cfg, max_seqs=1)
        for nb in range(0, blocks_needed(cfg.max_model_len, cfg) + 2):
            want = max(k for k in range(cfg.max_model_len + 1) if blocks_needed(k, cfg) <= nb)
            assert st._table_cap(nb) == want, (cfg, nb)


def test_fast_batch_tables_are_a_snapshot() -> None:
    """A fast batch's flat tables (made on first read) are those of its step, whatever the state
    does afterwards (appends, finish and slot reuse)."""
    st = BatchState(PLAIN, max_seqs=2)
    a = st.add_request("a", [1, 2, 3], [9], 0, num_computed=3)
    b = st.add_request("b", [4, 5], [6], 1, num_computed=2)
    batch = st.decode_batch(np.array([b, a]))
    assert isinstance(batch, StateDecodeBatch)
    st.append_blocks(a, [7])
    st.finish(b)
    assert st.add_request("c", [8], [2, 3], 1, num_computed=1) == b
    assert batch.block_tables.tolist() == [6, 9] and batch.block_table_offsets.tolist() == [0, 1, 2]


def test_fast_path_refuses_what_it_cannot_vouch_for() -> None:
    """A state id, valid start or block id out of the fast path's range (set at add_request, by a
    setter or by an append), a prefill not done, a too-short table: the general path runs and the
    builder raises its usual message."""
    st = BatchState(PLAIN, max_seqs=5)
    a = st.add_request("a", [1, 2, 3], [9], -1, num_computed=3)  # bad state id from add_request
    b = st.add_request("b", [4, 5], [6], 1, num_computed=2)
    assert not isinstance(st.decode_batch(np.array([a])), StateDecodeBatch)
    with pytest.raises(ValueError, match=r"seqs\[0\]\.state_id"):
        prepare_decode(st.decode_batch(np.array([a])), PLAIN)
    assert isinstance(st.decode_batch(np.array([b])), StateDecodeBatch)
    st.set_swa_valid_start(b, -2)
    assert not isinstance(st.decode_batch(np.array([b])), StateDecodeBatch)
    st.set_swa_valid_start(b, 0)
    st.append_blocks(b, [-3])
    assert not isinstance(st.decode_batch(np.array([b])), StateDecodeBatch)
    c = st.add_request("c", list(range(16)), [1], 2, num_computed=4)
    with pytest.raises(ValueError, match="still in prefill"):
        st.decode_batch(np.array([c]))
    st.prompt_batch(np.array([c]), np.array([12]))
    assert isinstance(st.decode_batch(np.array([c])), StateDecodeBatch)
    st.append_tokens(c, [5] * 3)  # 19 tokens: one 16-token block covers seqlen_k <= 19
    assert isinstance(st.decode_batch(np.array([c])), StateDecodeBatch)
    st.append_tokens(c, [5])  # 20 tokens need a second block
    assert not isinstance(st.decode_batch(np.array([c])), StateDecodeBatch)
    with pytest.raises(ValueError, match=r"seqs\[0\]\.block_table"):
        prepare_decode(st.decode_batch(np.array([c])), PLAIN)
    d = st.add_request("d", [1, 2], [1], 3, num_computed=2)
    assert isinstance(st.decode_batch(np.array([d])), StateDecodeBatch)
    st.append_tokens_batch(np.array([d]), np.array([2**31]), np.array([1]))  # a token past int32
    assert not isinstance(st.decode_batch(np.array([d])), StateDecodeBatch)
    with pytest.raises(ValueError, match=r"seqs\[0\]\.token_ids: expected ids in \[0, 2\*\*31 - 1\] \(input_ids"):
        prepare_decode(st.decode_batch(np.array([d])), PLAIN)  # the validation names the sequence
    e = st.add_request("e", [1, 2], [1], 4, num_computed=2)
    for bad in (-2**31 - 1, 2**31):  # a draft past int32: decode_batch names the request
        msg = rf"request 'e': draft_tokens: expected ids in \[0, 2\*\*31 - 1\], got {bad}"
        with pytest.raises(ValueError, match=msg):
            st.decode_batch(np.array([e]), np.array([bad]), np.array([1]))
    for bad in (7, 5, -1, -5, -6, -11):  # past max_seqs, or negative (wraps into the -1 half)
        with pytest.raises(ValueError, match="slots"):
            st.decode_batch(np.array([bad]))


def test_random_engine_yoco_prompts() -> None:
    seen = _run(YOCO, 7, 80)
    assert seen["prompt"] > 15, seen


def test_capacity_errors_leave_the_state_usable() -> None:
    st = BatchState(CFG, max_seqs=2, max_tokens=20, max_blocks=2)
    a = st.add_request("a", [1] * 10, [3], 0)
    with pytest.raises(ValueError, match=r"request 'b': 21 tokens exceed max_tokens=20"):
        st.add_request("b", [1] * 21, [3], 1)
    with pytest.raises(ValueError, match=r"request 'b': 3 block ids exceed max_blocks=2"):
        st.add_request("b", [1] * 5, [1, 2, 3], 1)
    with pytest.raises(ValueError, match=r"request 'a': already in the batch state"):
        st.add_request("a", [1], [3], 1)
    b = st.add_request("b", [2] * 4, [4], 1)
    with pytest.raises(ValueError, match=r"request 'c': all max_seqs=2 slots are in use"):
        st.add_request("c", [1], [3], 1)
    with pytest.raises(ValueError, match=r"request 'a': 21 tokens exceed max_tokens=20"):
        st.append_tokens(a, [5] * 11)
    with pytest.raises(ValueError, match=r"request 'a': 3 block ids exceed max_blocks=2"):
        st.append_blocks(a, [8, 9])
    with pytest.raises(ValueError, match=r"request 'b': 21 tokens exceed max_tokens=20"):
        st.append_tokens_batch(np.array([a, b]), np.array([7] * 18), np.array([1, 17]))
    with pytest.raises(ValueError, match=r"request 'a': chunk of 11 tokens"):
        st.prompt_batch(np.array([a]), np.array([11]))
    with pytest.raises(ValueError, match=r"request 'a': still in prefill"):
        st.decode_batch(np.array([a]))
    # nothing above changed the state: the same steps still work and match a list
    seqs = [SequenceMetadata(10, 10, [3], 0, [1] * 10)]
    assert metadata_diff(prepare_prompt(st.prompt_batch(np.array([a]), np.array([10])), CFG),
                         prepare_prompt(seqs, CFG), cfg=CFG) == []
    st.append_tokens(a, [6])
    got = prepare_decode(st.decode_batch(np.array([a]), np.array([4]), np.array([1])), CFG)
    want = prepare_decode([SequenceMetadata(2, 12, [3], 0, [1] * 10 + [6], draft_tokens=[4])], CFG)
    assert metadata_diff(got, want, cfg=CFG) == []
    st.finish(b)
    assert st.add_request("c", [1], [3], 1) == b  # slot reused
    with pytest.raises(ValueError, match="not in the batch state"):
        st.slot_of("b")


def test_decode_window_is_short() -> None:
    """A decode step reads look-back + last token + drafts, not the history."""
    st = BatchState(CFG, max_seqs=1)
    s = st.add_request(0, list(range(80)), list(range(blocks_needed(80, CFG))), 0, num_computed=80)
    batch = st.decode_batch(np.array([s]), np.array([7, 7]), np.array([2]))
    assert batch.tokens.tolist() == [77, 78, 79, 7, 7]


def test_decode_2d_table_follows_appends_and_reuse() -> None:
    """The 2-D padded table (``SequenceBatch._bt2d``) follows appends past max_num_blocks and slot reuse."""
    mnb = CFG.max_num_blocks
    st = BatchState(CFG, max_seqs=2, max_blocks=mnb + 3)
    a = st.add_request("a", [1, 2, 3], [9] * (mnb - 1), 0, num_computed=3)
    b = st.add_request("b", [4], [5, 6], 1, num_computed=1)
    st.append_blocks(a, [7, 8, 9])  # crosses max_num_blocks: the 2-D table keeps the first mnb
    batch = st.decode_batch(np.array([b, a]))
    assert _rows(batch, CFG) is not None
    _assert_bt2d(batch, CFG)
    st.finish(a)
    c = st.add_request("c", [4, 4], [3], 2, num_computed=2)
    assert c == a
    batch = st.decode_batch(np.array([c, b]), np.array([1]), np.array([0, 1]))
    _assert_bt2d(batch, CFG)
    assert _rows(batch, CFG)[0].tolist() == [3] + [-1] * (mnb - 1)
    assert _rows(st.decode_batch(np.array([c]), num_placeholders=1), CFG) is None  # placeholders: the flat path


@pytest.mark.parametrize("cfg_name", ["seed", "plain"])
def test_vectorized_appends_equal_one_call_per_request(cfg_name: str) -> None:
    """``append_blocks_batch`` / ``append_compressed_batch`` leave the state exactly as one
    ``append_blocks`` / ``append_compressed`` call per request would (every array, the int32
    mirrors and the decode fast path's caps), and refuse what the loop refuses, changing nothing."""
    from cpmeta.launch.scheduler import default_config, plain_config

    cfg = default_config(max_model_len=2048) if cfg_name == "seed" else plain_config(max_model_len=2048)
    rng = np.random.default_rng(5)
    a, b = (BatchState(cfg, 6, max_tokens=2048, max_blocks=64, max_compressed=64) for _ in range(2))
    for st in (a, b):
        for i in range(5):
            st.add_request(i, list(range(1, 41 + 9 * i)), [7] * blocks_needed(40 + 9 * i, cfg), i,
                           num_computed=40 + 9 * i)
            st.append_tokens(i, [3])
    for _ in range(20):
        slots = rng.permutation(5)[:rng.integers(1, 6)]
        counts = rng.integers(0, 3, len(slots))
        blocks = rng.integers(-1, 5000, int(counts.sum()))  # a -1 makes a table unvouched
        ids = rng.integers(0, 99, int(counts.sum()))
        at = 0
        for s, c in zip(slots.tolist(), counts.tolist()):
            a.append_blocks(s, blocks[at:at + c])
            a.append_compressed(s, ids[at:at + c])
            at += c
        b.append_blocks_batch(slots, blocks, counts)
        b.append_compressed_batch(slots, ids, counts)
    for name in ("block_table", "num_blocks", "compressed", "num_compressed", "block_rows32"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for s in range(5):
        assert (a.vouch_decode(np.array([s])) is None) == (b.vouch_decode(np.array([s])) is None), s
    before = b.block_table.copy(), b.num_blocks.copy()
    for bad in (([0, 0], [1, 2], [1, 1]), ([0, 9], [1, 2], [1, 1]), ([0], [1], [2]),
                ([0], list(range(b.max_blocks)), [b.max_blocks])):
        with pytest.raises(ValueError):
            b.append_blocks_batch(np.array(bad[0]), np.array(bad[1]), np.array(bad[2]))
    assert np.array_equal(before[0], b.block_table) and np.array_equal(before[1], b.num_blocks)
