"""``BatchState.add_requests_batch``: a step's new requests in one compiled call.

Both calls share one compiled add; the oracle is :func:`_reference`, the plain per-request rule
(the slot each add takes from the free list, what each array holds after it). On random batches
(hypothesis) the batch call and one ``add_request`` per request must both leave every array, the
request / slot maps and the free list as the reference says, and return its slots; a failing
check must raise the message written out here for the first failing request and add none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmeta import BatchState, MetadataConfig
from cpmeta.sequence import blocks_needed

#: Engram history ids and the sliding-window state cache (state ids must differ)
SEED = MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                      sparse_compress_ratios=(4, 8), max_model_len=96, max_ngram_size=3, image_token_id=5)
PAGED = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                       max_model_len=96)
CFGS = {"seed": SEED, "paged": PAGED}
ARRAYS = ("token_ids", "block_table", "compressed", "_meta", "active")


def _state(cfg: MetadataConfig, live: list[int], gone: list[int]) -> BatchState:
    """A state of 8 slots holding requests ``live`` after adding and finishing ``gone`` (so the
    free list is not in its first order)."""
    s = BatchState(cfg, max_seqs=8, max_tokens=48, max_blocks=4, max_compressed=6)
    slots = {r: s.add_request(r, [1, 2, 3], [0], 100 + r) for r in live + gone}
    for r in gone:
        s.finish(slots[r])
    return s


def _reference(s: BatchState, ids: list[Any], reqs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[int]]:
    """What adding ``reqs`` to ``s`` must leave, computed request by request without the state's
    code: each takes the last free slot; its row holds the prompt, the table (its first id
    outside ``[0, max_block_id]`` kept, else ``NO_BAD``) and the Engram ids; its counts and
    scalars are set."""
    from cpmeta.state.state_njit import (
        M_BLOCKS, M_COMPRESSED, M_COMPUTED, M_FIRST_BAD, M_PROMPT, M_STATE, M_TOKENS, M_VALID_START, NO_BAD,
    )

    want = {name: getattr(s, name).copy() for name in ARRAYS}
    free, slots, req = list(s._free), [], list(s._req)
    for r, q in zip(ids, reqs):
        slot = free.pop()
        slots.append(slot)
        req[slot] = r
        for name, key in (("token_ids", "toks"), ("block_table", "blocks"), ("compressed", "comp")):
            want[name][slot, :len(q[key])] = q[key]
        bad = [i for i, b in enumerate(q["blocks"]) if not 0 <= b <= s.cfg.max_block_id]
        m = want["_meta"]
        m[M_TOKENS, slot] = m[M_PROMPT, slot] = len(q["toks"])
        m[M_COMPUTED, slot], m[M_BLOCKS, slot], m[M_COMPRESSED, slot] = q["nc"], len(q["blocks"]), len(q["comp"])
        m[M_FIRST_BAD, slot] = bad[0] if bad else NO_BAD
        m[M_STATE, slot], m[M_VALID_START, slot] = q["sid"], q["vs"]
        want["active"][slot] = True
    want.update(_free=free, _req=req, _slot={**s._slot, **dict(zip(ids, slots))})
    return want, slots


def _matches(s: BatchState, want: dict[str, Any]) -> None:
    for name in ARRAYS:
        assert np.array_equal(getattr(s, name), want[name]), name
    assert s._free == want["_free"] and s._req == want["_req"] and s._slot == want["_slot"]


def _same(a: BatchState, b: BatchState) -> None:
    for name in ARRAYS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a._slot == b._slot and a._req == b._req and a._free == b._free


def _flat(reqs: list[dict[str, Any]]) -> tuple[Any, ...]:
    cat = lambda k: np.array([x for r in reqs for x in r[k]], np.int64)  # noqa: E731
    count = lambda k: np.array([len(r[k]) for r in reqs], np.int64)  # noqa: E731
    return cat("toks"), count("toks"), cat("blocks"), count("blocks"), cat("comp"), count("comp")


def _one_by_one(s: BatchState, ids: list[Any], reqs: list[dict[str, Any]]) -> list[int]:
    return [s.add_request(r, q["toks"], q["blocks"], q["sid"], compressed_token_ids=q["comp"],
                          swa_valid_start=q["vs"], num_computed=q["nc"]) for r, q in zip(ids, reqs)]


def _batch(s: BatchState, ids: list[Any], reqs: list[dict[str, Any]]) -> np.ndarray:
    toks, tc, blocks, bc, comp, cc = _flat(reqs)
    return s.add_requests_batch(ids, toks, tc, blocks, bc, [q["sid"] for q in reqs], compressed_ids=comp,
                                compressed_counts=cc, swa_valid_starts=[q["vs"] for q in reqs],
                                num_computed=[q["nc"] for q in reqs])


@st.composite
def requests(draw: Any, cfg_name: str) -> list[dict[str, Any]]:
    """0-6 requests that ``add_request`` accepts on a :func:`_state` (state ids 0-9: the live
    ones hold 100+); block ids may lie outside ``[0, max_block_id]`` (kept as the table's first
    bad id)."""
    cfg = CFGS[cfg_name]
    sids = draw(st.lists(st.integers(0, 9), max_size=6, unique=True))
    out = []
    for sid in sids:
        n = draw(st.integers(1, 48))
        out.append({
            "toks": draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
            "blocks": draw(st.lists(st.integers(-1, cfg.max_block_id + 1), max_size=4)),
            "comp": draw(st.lists(st.integers(0, 500), max_size=6 if cfg.max_ngram_size else 0)),
            "sid": sid, "vs": draw(st.integers(0, 40)), "nc": draw(st.integers(0, n))})
    return out


@pytest.mark.parametrize("cfg_name", sorted(CFGS))
@settings(max_examples=60)
@given(data=st.data())
def test_batch_add_and_add_request_equal_the_reference(cfg_name: str, data: Any) -> None:
    cfg = CFGS[cfg_name]
    reqs = data.draw(requests(cfg_name))
    live = data.draw(st.lists(st.integers(0, 3), max_size=2, unique=True))
    gone = data.draw(st.lists(st.integers(4, 7), max_size=3, unique=True))
    ids: list[Any] = [f"r{i}" for i in range(len(reqs))]
    a, b = _state(cfg, live, gone), _state(cfg, live, gone)
    ref, ref_slots = _reference(a, ids, reqs)
    want = _one_by_one(a, ids, reqs)
    assert want == ref_slots
    _matches(a, ref)
    got = b.add_requests_batch(ids, *_flat(reqs)[:4], [q["sid"] for q in reqs], compressed_ids=_flat(reqs)[4],
                               compressed_counts=_flat(reqs)[5], swa_valid_starts=[q["vs"] for q in reqs],
                               num_computed=[q["nc"] for q in reqs])
    assert got.dtype == np.int64 and got.tolist() == want
    _same(a, b)
    for s in want:  # what the in-place staging vouches for follows the tables' first bad id
        q = reqs[want.index(s)]
        if q["nc"] == len(q["toks"]):
            one = np.array([s])
            assert (a.vouch_decode(one) is None) == (b.vouch_decode(one) is None)


def _req(toks: list[int], blocks: list[int], sid: int, *, comp: tuple = (), vs: int = 0, nc: int = 0) -> dict:
    return {"toks": toks, "blocks": blocks, "comp": list(comp), "sid": sid, "vs": vs, "nc": nc}


GOOD = _req([1, 2], [0], 7)
BAD = [  # (requests, the message add_request raises for the first failing one)
    ([GOOD, _req([1] * 49, [0], 8)], r"request 'r1': 49 tokens exceed max_tokens=48"),
    ([GOOD, _req([1], [0] * 5, 8)], r"request 'r1': 5 block ids exceed max_blocks=4"),
    ([_req([1], [0], 8, comp=(1,) * 7), GOOD], r"request 'r0': 7 compressed ids exceed max_compressed=6"),
    ([GOOD, _req([], [0], 8)], r"request 'r1': expected a non-empty prompt"),
    ([GOOD, _req([1, 2], [0], 8, nc=3)], r"request 'r1': num_computed 3 outside \[0, 2\]"),
    ([GOOD, _req([1, 2], [0], 8, nc=-1)], r"request 'r1': num_computed -1 outside \[0, 2\]"),
    ([GOOD, _req([4, -5], [0], 8)], r"request 'r1': prompt_token_ids: expected ids >= 0, got -5 at index 1"),
    ([GOOD, _req([1], [0], 100)], r"request 'r1': state_id 100 is held by request 0 \(slot 0\)"),
    ([GOOD, _req([1], [0], 7)], r"request 'r1': state_id 7 is held by request 'r0' \(slot 1\)"),
    ([GOOD] * 8, r"request 'r7': all max_seqs=8 slots are in use"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_a_refused_batch_names_what_add_request_names_and_adds_none(case: int) -> None:
    reqs, msg = BAD[case]
    reqs = [dict(q, sid=q["sid"] + 20 * i if i and q is GOOD else q["sid"]) for i, q in enumerate(reqs)]
    ids: list[Any] = [f"r{i}" for i in range(len(reqs))]
    a, b = _state(SEED, [0], []), _state(SEED, [0], [])
    with pytest.raises(ValueError, match=msg):
        _one_by_one(a, ids, reqs)
    before = _state(SEED, [0], [])
    with pytest.raises(ValueError, match=msg):
        _batch(b, ids, reqs)
    _same(before, b)  # nothing added, not even the requests before the failing one


def test_ids_counts_and_values_are_checked_before_any_request() -> None:
    s = _state(PAGED, [0], [])
    before = _state(PAGED, [0], [])
    cases = [
        (([0], [1], [1], [0], [1], [3]), ValueError, r"request 0: already in the batch state \(slot 0\)"),
        ((["a", "b", "a"], [1, 2, 3], [1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 2, 3]), ValueError,
         r"request 'a': given twice in one add_requests_batch call \(positions 0 and 2\)"),
        ((["a"], [1, 2], [1], [0], [1], [1]), ValueError, r"token_counts: expected 1 counts >= 0 summing to 2 token_ids"),
        ((["a"], [1], [1], [0], [2], [1]), ValueError, r"block_counts: expected 1 counts >= 0 summing to 1 block_ids"),
        ((["a"], [1], [1, 0], [0], [1], [1]), ValueError, r"token_counts: expected 1 counts"),
        ((["a"], [1.0], [1], [0], [1], [1]), TypeError, r"token_ids: expected ints, got float64 values"),
        ((["a"], [1], [1], [0], [1], [1, 2]), ValueError, r"state_ids: expected 1 values \(one per request\), got 2"),
        (([["a"]], [1], [1], [0], [1], [1]), TypeError,
         r"request \['a'\]: a request id is hashable \(an int, a str, ...\), got list"),
        ((None, [1], [1], [0], [1], [1]), TypeError, r"req_ids: expected a sequence of request ids, got None"),
        (("ab", [1, 2], [1, 1], [0, 0], [1, 1], [1, 2]), TypeError, r"req_ids: .* got 'ab'"),  # not 'a', 'b'
    ]
    for args, err, msg in cases:
        with pytest.raises(err, match=msg):
            s.add_requests_batch(*args)
        _same(before, s)
    with pytest.raises(ValueError, match=r"compressed_counts: expected 1 counts >= 0 summing to 1 compressed_ids"):
        s.add_requests_batch(["a"], [1], [1], [0], [1], [1], compressed_ids=[5])
    assert s.add_requests_batch([], [], [], [], [], []).tolist() == []
    _same(before, s)


def test_a_batch_of_the_workload_sizes_matches_and_compiles_once() -> None:
    """Eight 4096-token prompts (the bench's prompt step) with int32 inputs; one specialization."""
    from cpmeta.state.requests_njit import add_rows

    cfg = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                         max_model_len=8192)
    a, b = BatchState(cfg, 16), BatchState(cfg, 16)
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 32000, 8 * 4096).astype(np.int32)
    nb = blocks_needed(4096, cfg)
    blocks = np.arange(8 * nb, dtype=np.int32)
    want = [a.add_request(i, toks[i * 4096:(i + 1) * 4096], blocks[i * nb:(i + 1) * nb], i) for i in range(8)]
    got = b.add_requests_batch(range(8), toks, np.full(8, 4096, np.int32), blocks, np.full(8, nb), np.arange(8))
    assert got.tolist() == want
    _same(a, b)
    assert len(add_rows.signatures) == 1, add_rows.signatures


def _replicated_rank(rank: int, world: int, defer: bool) -> list[Any]:
    """The driver adds a step's requests in one call (after two refused calls); every rank's
    replica holds them in the driver's slots."""
    import cpmeta

    out: list[Any] = []
    with cpmeta.ReplicatedBatchState(SEED, 4, max_tokens=48, max_blocks=4, max_compressed=6, timeout=60,
                                     defer_apply=defer) as rep:
        if rank == 0:
            for bad in ((["a"], [1, 2], [1], [0], [1], [3]), (["a", "b", "c", "d", "e"], [1] * 5, [1] * 5,
                                                               [0] * 5, [1] * 5, range(5))):
                try:
                    rep.add_requests_batch(*bad)
                except ValueError as e:
                    out.append(str(e))
            got = rep.add_requests_batch(["a", 7], [5, 6, 7], [2, 1], [3, 9], [1, 1], [0, 1],
                                         compressed_ids=[4], compressed_counts=[0, 1], num_computed=[2, 0])
            out.append(got.tolist())
            rep.prompt_batch(got[1:], np.array([1]))
        batch = rep.sync()
        st = rep.state
        out.append([st.slot_of("a"), st.slot_of(7), st.token_ids[st.slot_of("a"), :2].tolist(),
                    st.compressed[st.slot_of(7), :1].tolist(), int(st.num_computed[st.slot_of("a")]),
                    batch.seqlen_q.tolist()])
    return out


@pytest.mark.parametrize("defer", [False, True], ids=["apply", "defer_apply"])
def test_replicated_driver_adds_in_one_call(defer: bool) -> None:
    from multiproc import run_ranks

    out = run_ranks(_replicated_rank, 2, defer, timeout=120)
    assert out[0][:2] == ["token_counts: expected 1 counts >= 0 summing to 2 token_ids",
                          "request 'e': all max_seqs=4 slots are in use"], out[0]
    assert out[0][2] == [0, 1]
    want = [0, 1, [5, 6], [4], 2, [1]]
    assert out[0][3] == want and out[1][0] == want, out


@pytest.mark.parametrize("which, counts, message", [
    ("token", [2, -1], "token_counts: expected 2 counts >= 0 summing to 3 token_ids"),
    ("token", [3], "token_counts: expected 2 counts >= 0 summing to 3 token_ids"),
    ("block", [1, 0], "block_counts: expected 2 counts >= 0 summing to 2 block_ids"),
    ("compressed", [0, 2], "compressed_counts: expected 2 counts >= 0 summing to 1 compressed_ids"),
    ("compressed", [-(1 << 62), (1 << 62) + 1], "compressed_counts: expected 2 counts >= 0 summing to 1 "
                                                "compressed_ids"),
])
def test_op_log_records_an_add_run_only_when_its_counts_add_up(which: str, counts: list[int], message: str) -> None:
    """The replicated driver's record of ``add_requests_batch`` (``OpLog.add_many``, what a
    ``defer_apply`` driver checks before it sends): counts that are not one value >= 0 per
    request summing to the flat ids are refused by name and record nothing; good ones record
    one ``add_meta`` row per request (slot, state id, valid start, num computed, counts)."""
    from cpmeta.replicate.ops import ADD, OpLog, TOK

    ints = lambda v: np.array(v, np.int64)  # noqa: E731
    args = {"token": [ints([5, 6, 7]), ints([2, 1])], "block": [ints([3, 9]), ints([1, 1])],
            "compressed": [ints([4]), ints([0, 1])]}
    log = OpLog(4)
    log.ragged(TOK, ints([1]), ints([1]), ints([8]))
    before = [c.copy() for c in log.columns(np.zeros((0, 4), np.int64))]
    bad = {k: [v[0], ints(counts) if k == which else v[1]] for k, v in args.items()}
    scalars = ints([[10, 11], [0, 2], [1, 0]])
    with pytest.raises(ValueError, match=f"^{message}$"):
        log.add_many(ints([0, 2]), ["a", "b"], scalars, *bad["token"], *bad["block"], *bad["compressed"])
    after = log.columns(np.zeros((0, 4), np.int64))
    assert all(np.array_equal(a, b) for a, b in zip(after, before)) and log.req_ids == []
    log.add_many(ints([0, 2]), ["a", "b"], scalars, *args["token"], *args["block"], *args["compressed"])
    cols = log.columns(np.zeros((0, 4), np.int64))
    assert cols[0].tolist() == [[TOK, 1], [ADD, 2]] and log.req_ids == ["a", "b"]
    assert cols[1].tolist() == [[0, 10, 0, 1, 2, 1, 0], [2, 11, 2, 0, 1, 1, 1]]
    assert [c.tolist() for c in cols[2:5]] == [[5, 6, 7], [3, 9], [4]]


def _finish_reference(s: BatchState, slots: list[int]) -> dict[str, Any]:
    """What finishing ``slots`` in order must leave, without the state's code: each slot's
    request gone from the maps, its row inactive with zero token / block / Engram counts (the
    rest of its row as it was), the slot appended to the free list."""
    from cpmeta.state.state_njit import M_BLOCKS, M_COMPRESSED, M_TOKENS

    want = {name: getattr(s, name).copy() for name in ARRAYS}
    free, req, book = list(s._free), list(s._req), dict(s._slot)
    for slot in slots:
        del book[req[slot]]
        req[slot] = None
        want["active"][slot] = False
        for row in (M_TOKENS, M_BLOCKS, M_COMPRESSED):
            want["_meta"][row, slot] = 0
        free.append(slot)
    want.update(_free=free, _req=req, _slot=book)
    return want


@pytest.mark.parametrize("cfg_name", sorted(CFGS))
@settings(max_examples=60)
@given(data=st.data())
def test_finish_batch_and_finish_equal_the_reference(cfg_name: str, data: Any) -> None:
    """Random live and finished requests, then any subset of the live slots in any order: ONE
    ``finish_batch`` and one ``finish`` per slot both leave what the reference says, and the
    next adds take the slots back in the same order."""
    live = data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=8, unique=True))
    gone = data.draw(st.lists(st.integers(31, 60), max_size=8 - len(live), unique=True))
    a, b = _state(CFGS[cfg_name], live, gone), _state(CFGS[cfg_name], live, gone)
    order = data.draw(st.permutations([a.slot_of(r) for r in live]))
    slots = order[:data.draw(st.integers(0, len(order)))]
    want = _finish_reference(a, slots)
    a.finish_batch(np.array(slots, np.int64))
    for s in slots:
        b.finish(s)
    _matches(a, want)
    _matches(b, want)
    assert [a.add_request(f"n{i}", [1], [0], 200 + i) for i in range(len(slots))] == \
        [b.add_request(f"n{i}", [1], [0], 200 + i) for i in range(len(slots))]


@pytest.mark.parametrize("slots, err, message", [
    ([0, 6], ValueError, r"slots: expected slots of live requests, got \[6\] without one"),
    ([2, -1, 9], ValueError, r"slots: expected slots of live requests, got \[-1, 9\] without one"),
    ([1, 0, 1], ValueError, r"slots: request 1 \(slot 1\) appears twice in one step"),
    ([True], TypeError, r"slots: expected ints, got bool values"),
    ([1.0], TypeError, r"slots: expected ints, got float64 values"),
])
def test_finish_batch_refuses_by_name_and_finishes_none(slots: list[Any], err: type, message: str) -> None:
    """A slot without a live request, one given twice, or non-int slots: the named error, and
    no request of the call is finished."""
    s = _state(PAGED, [0, 1, 2], [3])
    want = {name: getattr(s, name).copy() for name in ARRAYS}
    want.update(_free=list(s._free), _req=list(s._req), _slot=dict(s._slot))
    with pytest.raises(err, match=f"^{message}$"):
        s.finish_batch(slots)
    _matches(s, want)
    s.finish_batch([])  # nothing to finish: nothing changes
    _matches(s, want)
