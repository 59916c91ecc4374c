"""``BatchState`` (docs/design.md section 13): a seeded random engine drives it for hundreds of steps; every step's
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
from cpmeta.state.state_njit import _blocks_needed, state_params

CFG = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                     sparse_compress_ratios=(4, 8), max_model_len=96, max_ngram_size=3, image_token_id=5)
#: no Engram: a decode window is the last confirmed token and the drafts
PLAIN = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                       sparse_compress_ratios=(4, 8), max_model_len=96)
#: a plain paged-KV model (docs/design.md section 14: no ratios, no sliding window), and its KV sharded over 3
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


FIELDS = ("seqlen_q", "seqlen_k", "state_id", "swa_valid_start", "is_placeholder", "num_tokens", "block_tables",
          "block_table_offsets", "tokens", "token_offsets", "compressed", "compressed_offsets")


def _assert_same_batch(batch: SequenceBatch, want: SequenceBatch) -> None:
    """The state's batch equals the list path's (``SequenceBatch.from_sequences``, which reads
    every field sequence by sequence) array by array, dtypes included."""
    for name in FIELDS:
        a, b = getattr(batch, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), (name, a, b)
    assert batch.lookback == want.lookback and batch.is_prompt is want.is_prompt


def _free_state(rng: random.Random, reqs: dict[int, _Req]) -> int:
    """A state id in [0, 50) no live request holds (the state cache refuses a shared one)."""
    return rng.choice(sorted(set(range(50)) - {r.state for r in reqs.values()}))


def _run(cfg: MetadataConfig, seed: int, steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    st = BatchState(cfg, max_seqs=6, max_tokens=cfg.max_model_len)
    reqs: dict[int, _Req] = {}
    seen = {"prompt": 0, "decode": 0, "errors": 0, "finished": 0, "vouched": 0}
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
            _assert_same_batch(batch, SequenceBatch.from_sequences(seqs, cfg, is_prompt=True))
            seen["vouched"] += batch.vouch_for(cfg) is not None
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
            _assert_same_batch(batch, SequenceBatch.from_sequences(seqs, cfg, is_prompt=False))
            seen["vouched"] += batch.vouch_for(cfg) is not None
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
    assert seen["vouched"] > 40, seen


@pytest.mark.parametrize("cfg", [PAGED, PAGED_KV3], ids=["plain", "plain_kv_sharded"])
def test_random_engine_plain_config_matches_lists(cfg: MetadataConfig) -> None:
    """A plain paged-KV config (its KV sharded too): the state's batches build what the lists do,
    with tables of ``blocks_needed`` blocks."""
    seen = _run(cfg, 3, 200)
    assert seen["prompt"] > 20 and seen["decode"] > 20 and seen["vouched"] > 30, seen


@pytest.mark.parametrize("seed", [1, 2])
def test_random_engine_no_lookback_matches_lists(seed: int) -> None:
    """Without Engram (decode windows without look-back) every batch equals the list path's and
    builds its metadata."""
    seen = _run(PLAIN, seed, 250)
    assert seen["decode"] > 30 and seen["vouched"] > 40 and seen["finished"] > 5, seen


def test_kernel_block_rule_is_blocks_needed() -> None:
    """The gather's and the staging vouch's block rule (``state_njit._blocks_needed``) equals
    ``blocks_needed`` of the config, KV-sharded and compressed configs included."""
    sharded = [MetadataConfig(block_size=bs, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                              max_model_len=mml, kv_cp_world_size=w, kv_cp_interleave=i)
               for bs, mml, w, i in ((16, 300, 3, 1), (8, 200, 3, 4), (8, 97, 2, 8), (4, 50, 4, 2), (16, 64, 1, 4))]
    for cfg in (PLAIN, CFG, PAGED, *sharded,
                MetadataConfig.compressed_swa(block_size=32, dense_compress_ratios=(4, 32), sparse_compress_ratios=(8,),
                               max_model_len=200)):
        p = state_params(cfg, 0)
        for k in range(cfg.max_model_len + 2):
            assert _blocks_needed(k, p) == blocks_needed(k, cfg), (cfg, k)


def test_batches_are_snapshots() -> None:
    """A batch holds its step's values whatever the state does afterwards (appends, finish, slot
    reuse, the next step's gather)."""
    st = BatchState(PLAIN, max_seqs=2)
    a = st.add_request("a", [1, 2, 3], [9], 0, num_computed=3)
    b = st.add_request("b", [4, 5], [6], 1, num_computed=1)
    pre = st.prompt_batch(np.array([b]), np.array([1]), num_placeholders=1)
    dec = st.decode_batch(np.array([b, a]), np.array([7, 8]), 1)
    want = {n: getattr(dec, n).copy() for n in FIELDS}
    want_pre = {n: getattr(pre, n).copy() for n in FIELDS}
    st.append_blocks(a, [7])
    st.append_tokens_batch(np.array([a, b]), np.array([5, 6]), np.array([1, 1]))
    st.finish(b)
    assert st.add_request("c", [8], [2, 3], 1, num_computed=1) == b
    st.decode_batch(np.array([b, a]), np.array([1, 2]), 1)
    for n in FIELDS:
        assert np.array_equal(getattr(dec, n), want[n]) and np.array_equal(getattr(pre, n), want_pre[n]), n
    assert dec.block_tables.tolist() == [6, 9] and dec.tokens.tolist() == [5, 7, 3, 8]


def test_unvouched_batches_are_named_by_the_builders() -> None:
    """A state id, valid start or block table out of range (set at add_request, by a setter or by
    an append), a table too short, a window token past int32: the batch comes back unchecked and
    the builder raises its usual message; ``vouch_decode`` (the GPU staging's fast path) declines."""
    st = BatchState(PLAIN, max_seqs=5)
    a = st.add_request("a", [1, 2, 3], [9], -1, num_computed=3)  # bad state id from add_request
    b = st.add_request("b", [4, 5], [6], 1, num_computed=2)
    assert st.decode_batch(np.array([a])).vouch_for(PLAIN) is None and st.vouch_decode(np.array([a])) is None
    with pytest.raises(ValueError, match=r"seqs\[0\]\.state_id"):
        prepare_decode(st.decode_batch(np.array([a])), PLAIN)
    assert st.decode_batch(np.array([b])).vouch_for(PLAIN) is not None and st.vouch_decode(np.array([b]))
    st.set_swa_valid_start(b, -2)
    assert st.decode_batch(np.array([b])).vouch_for(PLAIN) is None and st.vouch_decode(np.array([b])) is None
    st.set_swa_valid_start(b, 0)
    st.append_blocks(b, [-3])  # past the needed block: the batch is valid, the staging declines
    assert st.decode_batch(np.array([b])).vouch_for(PLAIN) is not None and st.vouch_decode(np.array([b])) is not None
    assert st.vouch_decode(np.array([b]), np.array([1] * 18), 18) is None  # seqlen_k 20 reads block -3
    c = st.add_request("c", list(range(16)), [1], 2, num_computed=4)
    with pytest.raises(ValueError, match="still in prefill"):
        st.decode_batch(np.array([c]))
    assert st.vouch_decode(np.array([c])) is None
    st.prompt_batch(np.array([c]), np.array([12]))
    assert st.decode_batch(np.array([c])).vouch_for(PLAIN) is not None
    st.append_tokens(c, [5] * 3)  # 19 tokens: one 16-token block covers seqlen_k <= 19
    assert st.decode_batch(np.array([c])).vouch_for(PLAIN) is not None and st.vouch_decode(np.array([c]))
    st.append_tokens(c, [5])  # 20 tokens need a second block
    assert st.decode_batch(np.array([c])).vouch_for(PLAIN) is None and st.vouch_decode(np.array([c])) is None
    with pytest.raises(ValueError, match=r"seqs\[0\]\.block_table"):
        prepare_decode(st.decode_batch(np.array([c])), PLAIN)
    d = st.add_request("d", [1, 2], [1], 3, num_computed=2)
    assert st.decode_batch(np.array([d])).vouch_for(PLAIN) is not None
    st.append_tokens_batch(np.array([d]), np.array([2**31]), np.array([1]))  # a token past int32
    assert st.decode_batch(np.array([d])).vouch_for(PLAIN) is None and st.vouch_decode(np.array([d])) is None
    with pytest.raises(ValueError, match=r"seqs\[0\]\.token_ids: expected ids in \[0, 2\*\*31 - 1\] \(input_ids"):
        prepare_decode(st.decode_batch(np.array([d])), PLAIN)  # the validation names the sequence
    st.append_tokens(d, [3])  # the id past int32 leaves the window: valid again
    assert st.decode_batch(np.array([d])).vouch_for(PLAIN) is not None and st.vouch_decode(np.array([d]))
    e = st.add_request("e", [1, 2], [1], 4, num_computed=2)
    for bad in (-2**31 - 1, 2**31):  # a draft past int32: decode_batch names the request
        msg = rf"request 'e': draft_tokens: expected ids in \[0, 2\*\*31 - 1\], got {bad}"
        with pytest.raises(ValueError, match=msg):
            st.decode_batch(np.array([e]), np.array([bad]), np.array([1]))
        assert st.vouch_decode(np.array([e]), np.array([bad]), np.array([1])) is None
    for bad in (7, 5, -1, -5, -6, -11):  # past max_seqs, or negative
        with pytest.raises(ValueError, match="slots"):
            st.decode_batch(np.array([bad]))
        assert st.vouch_decode(np.array([bad])) is None
    with pytest.raises(ValueError, match=r"slots: request 'e' \(slot 4\) appears twice in one step"):
        st.decode_batch(np.array([e, d, e]))
    assert st.vouch_decode(np.array([e, d, e])) is None


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


def test_vouch_decode_refuses_exactly_the_steps_that_need_a_bad_block_id() -> None:
    """``vouch_decode`` reads each table's first out-of-range id (kept by ``add_request``, every
    block append and ``finish``) instead of scanning the table: it vouches for a step iff none of
    the ``blocks_needed(seqlen_k)`` ids a slot needs is outside ``[0, max_block_id]`` -- checked
    against that definition over random tables grown in pieces (single and batch appends), bad
    ids at random places, slots finished and reused."""
    rng = random.Random(11)
    cfg = PAGED
    st = BatchState(cfg, max_seqs=4, max_blocks=cfg.max_num_blocks)
    bad_ids = (-1, -7, cfg.max_block_id + 1)

    def block() -> int:
        return rng.choice(bad_ids) if rng.random() < 0.08 else rng.randrange(1000)

    live: dict[int, int] = {}
    checked = refused = 0
    for i in range(300):
        if len(live) < 4 and (not live or rng.random() < 0.2):
            n = rng.randrange(1, 40)
            s = st.add_request(i, [1] * n, [block() for _ in range(rng.randrange(0, 4))], len(live) + i, num_computed=n)
            live[s] = i
        s = rng.choice(list(live))
        k = rng.randrange(1, 4)
        if st.num_blocks[s] + k <= st.max_blocks:
            new = [block() for _ in range(k)]
            if rng.random() < 0.5:
                st.append_blocks(s, new)
            else:
                st.append_blocks_batch(np.array([s]), np.array(new), np.array([k]))
        if st.num_tokens[s] + 1 < cfg.max_model_len:
            st.append_tokens(s, [2])
        for slot in live:
            need = blocks_needed(int(st.num_tokens[slot]), cfg)
            ids = st.block_table[slot, :need].tolist()
            ok = need <= st.num_blocks[slot] and all(0 <= b <= cfg.max_block_id for b in ids)
            assert (st.vouch_decode(np.array([slot])) is not None) == ok, (i, slot)
            checked += 1
            refused += not ok
        if rng.random() < 0.1 and len(live) > 1:
            done = rng.choice(list(live))
            st.finish(done)
            del live[done]
    assert checked > 500 and 50 < refused < checked - 50  # both outcomes, many times


def test_append_errors_name_the_request_and_change_nothing() -> None:
    """The batch appends' checks (slots, counts, capacity, token ids) come before any write."""
    st = BatchState(PAGED, max_seqs=3, max_tokens=8, max_blocks=2)
    a = st.add_request("a", [1, 2], [3], 0)
    b = st.add_request("b", [4], [5], 1)
    before = [x.copy() for x in (st.token_ids, st.block_table, st._meta)]
    bad = [
        ("append_tokens_batch", [a, 2], [1, 2], [1, 1],
         r"slots: expected slots of live requests, got \[2\] without one"),
        ("append_tokens_batch", [a, -1, 7], [1, 2], [1, 1, 0], r"got \[-1, 7\] without one"),
        ("append_blocks_batch", [b, a, b], [1, 2], [1, 1, 0], r"slots: request 'b' \(slot 1\) appears twice"),
        ("append_tokens_batch", [a, b], [1, 2], [1, 2], r"counts: expected 2 counts >= 0 summing to 2 tokens"),
        ("append_blocks_batch", [a, b], [1, 2], [3, -1], r"counts: expected 2 counts >= 0 summing to 2 block ids"),
        ("append_compressed_batch", [a], [1], [1, 0], r"counts: expected 1 counts >= 0 summing to 1 compressed ids"),
        ("append_tokens_batch", [b, a], [1] * 8, [1, 7], r"request 'a': 9 tokens exceed max_tokens=8"),
        ("append_blocks_batch", [a, b], [1, 2], [0, 2], r"request 'b': 3 block ids exceed max_blocks=2"),
        ("append_compressed_batch", [a], [1], [1], r"request 'a': 1 compressed ids exceed max_compressed=0"),
        ("append_tokens_batch", [a, b], [1, 2, -4], [1, 2],
         r"request 'b': tokens: expected ids >= 0, got -4 at index 1"),
    ]
    for name, slots, vals, counts, msg in bad:
        with pytest.raises(ValueError, match=msg):
            getattr(st, name)(np.array(slots), np.array(vals), np.array(counts))
    with pytest.raises(ValueError, match=r"request 'a': tokens: expected ids >= 0, got -1 at index 9"):
        st.append_tokens(a, [1] * 9 + [-1])  # the ids are named before the capacity
    with pytest.raises(ValueError, match=r"request 'a': 12 tokens exceed max_tokens=8"):
        st.append_tokens(a, [1] * 10)
    with pytest.raises(ValueError, match=r"slot 2: no live request there"):
        st.append_blocks(2, [1])
    for x, y in zip(before, (st.token_ids, st.block_table, st._meta)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("cfg_name", ["seed", "plain"])
def test_vectorized_appends_equal_one_call_per_request(cfg_name: str) -> None:
    """``append_blocks_batch`` / ``append_compressed_batch`` leave the state exactly as one
    ``append_blocks`` / ``append_compressed`` call per request would (every array, what the
    staging vouches for), and refuse what the loop refuses, changing nothing."""
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
    for name in ("block_table", "num_blocks", "compressed", "num_compressed"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for s in range(5):
        assert (a.vouch_decode(np.array([s])) is None) == (b.vouch_decode(np.array([s])) is None), s
    before = b.block_table.copy(), b.num_blocks.copy()
    for bad in (([0, 0], [1, 2], [1, 1]), ([0, 9], [1, 2], [1, 1]), ([0], [1], [2]),
                ([0], list(range(b.max_blocks)), [b.max_blocks])):
        with pytest.raises(ValueError):
            b.append_blocks_batch(np.array(bad[0]), np.array(bad[1]), np.array(bad[2]))
    assert np.array_equal(before[0], b.block_table) and np.array_equal(before[1], b.num_blocks)


def test_one_compiled_specialization_per_kernel() -> None:
    """Read-only, strided and int32 arguments reach the kernels as contiguous writable int64
    arrays: each kernel compiles once (a new argument type would compile, and cache, another)."""
    from cpmeta.state.state_njit import append_rows, gather_step, vouch_step

    st = BatchState(PAGED, max_seqs=4)
    a = st.add_request("a", [1, 2, 3], [7], 0, num_computed=2)
    b = st.add_request("b", [4, 5], [8], 1, num_computed=2)
    ro = np.array([b])
    ro.flags.writeable = False
    st.decode_batch(ro)
    st.decode_batch(np.array([b, 9])[::2], np.array([1], np.int32), np.array([1, 1], np.int32)[::2])
    st.decode_batch(np.array([b], np.int32), ro, 1)
    st.prompt_batch(np.array([a]), np.array([1], np.uint8), advance=False)
    assert st.vouch_decode(np.array([b]), np.array([1, 2]), np.array([2], np.int32)) is not None
    st.append_tokens_batch(ro, np.array([1], np.int32), np.array([1]))
    st.append_blocks_batch(np.array([a, 9])[::2], ro, np.array([1], np.int16))
    st.append_tokens(a, (3,))
    for k in (append_rows, gather_step, vouch_step):
        assert len(k.signatures) == 1, (k, k.signatures)
