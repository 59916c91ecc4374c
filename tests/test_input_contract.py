"""The input contract, closed (issue 33 item 6): each gap found by trying bad input on the public API
is a clear ``ValueError`` / ``TypeError`` naming the sequence (or request) and the field, and a
refusal changes nothing.

- two non-placeholder sequences sharing a ``state_id`` under the SWA state cache (they would write
  the same ``slot_mapping_store_swa`` slots): list and ``SequenceBatch`` input, ``BatchState``
  (a state id held by another live request, a slot given twice to a step);
- negative token / draft ids everywhere they enter;
- numpy integer scalars accepted wherever an int is taken (same metadata as Python ints), bools
  and floats refused;
- a negative ``seqlen_k`` named as such; int32 overflow of input / block / state ids named by
  sequence; ``blocks_needed`` of a float or a negative count.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import numpy as np
import pytest

from cpmeta import BatchState, MetadataConfig, SequenceBatch, SequenceMetadata, blocks_needed, prepare_decode, prepare_prompt
from cpmeta.diff import metadata_diff
from cpmeta.sequence import validate_batch

#: the SWA state cache on (W = S = 4), block 16, ratios 4 / 8
SWA = MetadataConfig(block_size=16, window_size=4, swa_block_size=4, dense_compress_ratios=(4,),
                     sparse_compress_ratios=(8,), max_model_len=64)
#: a plain paged-KV model: no state cache, so no field reads a state id
PLAIN = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                       max_model_len=64)


def _p(state: int, k: int = 5, **kw: Any) -> SequenceMetadata:
    """A prompt chunk: 2 queries of ``k`` keys, one block."""
    return SequenceMetadata(2, k, kw.pop("table", [1, 2]), state, kw.pop("tokens", list(range(10, 10 + k))), **kw)


def _d(state: int, k: int = 5, **kw: Any) -> SequenceMetadata:
    """A decode step: 2 queries (one draft) of ``k`` keys."""
    return SequenceMetadata(2, k, kw.pop("table", [1, 2]), state, kw.pop("tokens", list(range(10, 9 + k))),
                            draft_tokens=kw.pop("drafts", [7]), **kw)


def _all_inputs(seqs: list[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> list[Callable[[], Any]]:
    """Every public way the batch reaches a builder: validate_batch, the list, from_sequences, a
    SequenceBatch built from the same arrays and validated by the builder."""
    build = prepare_prompt if is_prompt else prepare_decode

    def from_arrays() -> Any:
        sb = SequenceBatch.from_sequences(seqs, cfg, is_prompt=is_prompt)
        raise AssertionError(f"from_sequences accepted it: {sb}")

    def user_arrays() -> Any:
        good = [SequenceMetadata(s.seqlen_q, s.seqlen_k, s.block_table, i, [1] * len(s.token_ids),
                                 s.is_placeholder, s.swa_valid_start, [1] * len(s.draft_tokens))
                for i, s in enumerate(seqs)]
        sb = SequenceBatch.from_sequences(good, cfg, is_prompt=is_prompt)  # valid layout, then the bad values
        fields = {f: getattr(sb, f) for f in SequenceBatch.__dataclass_fields__ if not f.startswith("_")}
        fields["state_id"] = np.array([s.state_id for s in seqs], np.int64)
        tokens = []
        for s in seqs:
            lo = max(s.seqlen_k - s.seqlen_q - sb.lookback, 0)
            tokens += list(s.token_ids[lo:s.seqlen_k]) if is_prompt else list(s.token_ids[lo:]) + list(s.draft_tokens)
        fields["tokens"] = np.array(tokens, np.int64)
        return build(SequenceBatch(**fields), cfg)

    return [lambda: validate_batch(seqs, cfg, is_prompt=is_prompt) or _check_values(seqs, cfg, is_prompt),
            lambda: build(seqs, cfg), from_arrays, user_arrays]


def _check_values(seqs: list[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> None:
    """validate_batch checks counts and scalars; the id values are checked when read into arrays."""
    SequenceBatch.from_sequences(seqs, cfg, is_prompt=is_prompt)


# ---- a state id shared by two sequences --------------------------------------------------------


@pytest.mark.parametrize("is_prompt", [True, False], ids=["prompt", "decode"])
def test_shared_state_id_refused_under_the_state_cache(is_prompt: bool) -> None:
    make = _p if is_prompt else _d
    seqs = [make(3), make(5), make(3)]
    msg = re.escape("seqs[2].state_id: expected a state id no other sequence of the batch holds (seqs[0] holds it")
    for call in _all_inputs(seqs, SWA, is_prompt):
        with pytest.raises(ValueError, match=msg):
            call()
    build = prepare_prompt if is_prompt else prepare_decode
    # why: with both sequences built, their rows write the same ring slots
    slots = build([make(3), make(5), make(4)], SWA).slot_mapping_store_swa.tolist()
    assert len(set(slots)) == len(slots)


@pytest.mark.parametrize("is_prompt", [True, False], ids=["prompt", "decode"])
def test_shared_state_id_allowed_without_the_state_cache_and_for_placeholders(is_prompt: bool) -> None:
    make = _p if is_prompt else _d
    build = prepare_prompt if is_prompt else prepare_decode
    md = build([make(0), make(0)], PLAIN)  # no field reads a state id: an engine without state passes 0
    assert md.slot_mapping_store_swa is None and md.state_block_idx is None
    ph = SequenceMetadata(1, 1, [0], 3, [0], is_placeholder=True)
    for seqs in ([make(3), ph], [ph, make(3), ph]):  # placeholders write no KV: exempt
        build(seqs, SWA)
        SequenceBatch.from_sequences(seqs, SWA, is_prompt=is_prompt).validate(SWA)


def _snapshot(st: BatchState) -> dict[str, Any]:
    """Every attribute of the state (deep copies), but the kernels' scratch (the repeated-slot
    check's, a single-slot call's arguments) and error slot, which hold nothing between calls."""
    return {k: copy.deepcopy(v) for k, v in vars(st).items() if k not in ("_seen", "_err", "_one", "_one_count")}


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _refused(st: BatchState, call: Callable[[], Any], exc: type, msg: str) -> None:
    """``call`` raises ``exc`` matching ``msg`` and leaves every array and map of ``st`` as it was."""
    before = _snapshot(st)
    with pytest.raises(exc, match=msg):
        call()
    _assert_same(before, _snapshot(st))


def test_batch_state_refuses_a_held_state_id() -> None:
    st = BatchState(SWA, max_seqs=4)
    a = st.add_request("a", [1, 2, 3], [1], 0, num_computed=3)
    b = st.add_request("b", [1, 2, 3], [2], 1, num_computed=3)
    held = r"request '{}': state_id {} is held by request '{}' \(slot {}\)"
    _refused(st, lambda: st.add_request("c", [1, 2], [3], 1), ValueError, held.format("c", 1, "b", b))
    _refused(st, lambda: st.set_state_id(b, 0), ValueError, held.format("b", 0, "a", a))
    st.set_state_id(b, 1)  # its own id: fine
    st.set_state_id(b, 2)  # a free one, then the old one is free for another request
    assert st.add_request("c", [1, 2], [3], 1) == 2
    st.finish(a)
    st.add_request("d", [4], [4], 0)  # a finished request's id is free again
    plain = BatchState(PLAIN, max_seqs=2)  # no state cache: ids may repeat
    plain.add_request("a", [1], [1], 0)
    plain.set_state_id(plain.add_request("b", [1], [2], 0), 0)


def test_a_slot_twice_in_one_step_is_refused() -> None:
    """A request scheduled twice would write its KV (and SWA) slots twice, in every config."""
    for cfg in (SWA, PLAIN):
        st = BatchState(cfg, max_seqs=4)
        a = st.add_request("a", [1, 2, 3], [1], 0, num_computed=3)
        b = st.add_request("b", list(range(8)), [2], 1)
        msg = r"slots: request 'a' \(slot 0\) appears twice in one step"
        # the fast path declines, the general path names it
        _refused(st, lambda: st.decode_batch(np.array([a, a])), ValueError, msg)
        _refused(st, lambda: st.decode_batch(np.array([a, a]), np.array([5, 6]), 1), ValueError, msg)
        _refused(st, lambda: st.decode_batch(np.array([a, a]), num_placeholders=1), ValueError, msg)
        _refused(st, lambda: st.append_tokens_batch(np.array([a, a]), np.array([5, 6]), np.array([1, 1])),
                 ValueError, msg)
        msg_b = msg.replace("'a' \\(slot 0", "'b' \\(slot 1")
        _refused(st, lambda: st.prompt_batch(np.array([b, b]), np.array([2, 2])), ValueError, msg_b)
        assert st.vouch_decode(np.array([a, a])) is None and st.vouch_decode(np.array([a])) is not None


# ---- negative ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("where, is_prompt, field, index", [
    ({"tokens": [10, 11, 12, -5, 14]}, True, "token_ids", 3),
    ({"tokens": [10, 11, 12, -1]}, False, "token_ids", 3),  # the last confirmed token: an input id
    ({"drafts": [-7]}, False, "draft_tokens", 0),
    ({"tokens": [10, 11, 12, 13, 2**31]}, True, "token_ids", 4),  # int32 overflow of input_ids
    ({"drafts": [2**31]}, False, "draft_tokens", 0),
], ids=["prompt_token", "decode_token", "draft", "prompt_token_int32", "draft_int32"])
def test_bad_token_ids_name_the_sequence(where: dict[str, Any], is_prompt: bool, field: str, index: int) -> None:
    make = _p if is_prompt else _d
    seqs = [make(0), make(1, **where), make(2)]
    msg = re.escape(f"seqs[1].{field}: expected ids in [0, 2**31 - 1] (input_ids") + f".*at index {index}$"
    for call in _all_inputs(seqs, SWA, is_prompt):
        with pytest.raises(ValueError, match=msg):
            call()


def test_batch_state_refuses_negative_ids_where_they_enter() -> None:
    st = BatchState(SWA, max_seqs=4)
    a = st.add_request("a", [1, 2, 3], [1], 0, num_computed=3)
    b = st.add_request("b", [4, 5], [2], 1, num_computed=2)
    _refused(st, lambda: st.add_request("c", [1, -2, 3], [3], 2), ValueError,
             r"request 'c': prompt_token_ids: expected ids >= 0, got -2 at index 1")
    _refused(st, lambda: st.append_tokens(a, [6, -1]), ValueError,
             r"request 'a': tokens: expected ids >= 0, got -1 at index 1")
    _refused(st, lambda: st.append_tokens_batch(np.array([a, b]), np.array([6, 7, -3]), np.array([1, 2])),
             ValueError, r"request 'b': tokens: expected ids >= 0, got -3 at index 1")
    for drafts, counts in ((np.array([5, -9]), 1), (np.array([5, -9], np.int32), np.array([1, 1])),
                           (np.array([-9, 5, 6]), np.array([1, 2]))):
        who = "b" if drafts[0] >= 0 else "a"
        _refused(st, lambda: st.decode_batch(np.array([a, b]), drafts, counts), ValueError,
                 rf"request '{who}': draft_tokens: expected ids in \[0, 2\*\*31 - 1\], got -9 at index 0")
        assert st.vouch_decode(np.array([a, b]), drafts, counts) is None  # the staging fast path declines too
    md = prepare_decode(st.decode_batch(np.array([a, b]), np.array([5, 6], np.int32), 1), SWA)
    assert md.input_ids.tolist() == [3, 5, 5, 6]


# ---- numpy integer scalars ---------------------------------------------------------------------


@pytest.mark.parametrize("is_prompt", [True, False], ids=["prompt", "decode"])
def test_numpy_integer_scalars_are_ints(is_prompt: bool) -> None:
    make = _p if is_prompt else _d
    build = prepare_prompt if is_prompt else prepare_decode
    py = [make(0, swa_valid_start=1), make(1, k=9)]
    npy = [SequenceMetadata(np.int64(s.seqlen_q), np.int32(s.seqlen_k), s.block_table, np.uint16(s.state_id),
                            s.token_ids, swa_valid_start=np.int8(s.swa_valid_start), draft_tokens=s.draft_tokens)
           for s in py]
    validate_batch(npy, SWA, is_prompt=is_prompt)
    assert metadata_diff(build(npy, SWA), build(py, SWA), cfg=SWA) == []
    sb = SequenceBatch.from_sequences(npy, SWA, is_prompt=is_prompt)
    assert sb.seqlen_q.dtype == np.int64 and sb.state_id.tolist() == [0, 1]
    for bad in (True, 1.0, np.float64(2.0), np.bool_(True)):
        seqs = [make(0), SequenceMetadata(2, 5, [1, 2], bad, list(range(5)))]  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=re.escape("seqs[1].state_id: expected an int")):
            build(seqs, SWA)


def test_numpy_integer_scalars_in_the_config_and_batch_state() -> None:
    cfg = MetadataConfig(block_size=np.int64(16), window_size=np.int32(4), swa_block_size=np.int64(4),
                         dense_compress_ratios=(np.int64(4),), sparse_compress_ratios=(np.int8(8),),
                         max_model_len=np.int64(64))
    assert cfg == SWA and all(type(getattr(cfg, f)) is int for f in ("block_size", "window_size", "max_model_len"))
    assert type(cfg.dense_compress_ratios[0]) is int
    st = BatchState(SWA, max_seqs=2)
    a = st.add_request("a", np.array([1, 2, 3], np.int32), np.array([1], np.uint8), np.int64(0),
                       swa_valid_start=np.int16(0), num_computed=np.int64(3))
    st.set_state_id(np.int64(a), np.int32(1))
    st.set_swa_valid_start(np.int64(a), np.uint8(1))
    st.append_tokens(np.int32(a), np.array([4], np.int16))
    batch = st.decode_batch(np.array([a]), np.array([5]), np.int64(1), num_placeholders=np.int64(1))
    assert batch.state_id.tolist() == [1, 0] and batch.tokens.tolist() == [4, 5, 0]
    assert blocks_needed(np.int64(17), SWA) == blocks_needed(17, SWA) == 1


def test_batch_state_refuses_bools_and_floats_as_ints() -> None:
    st = BatchState(SWA, max_seqs=2)
    a = st.add_request("a", [1, 2, 3], [1], 0, num_computed=3)
    for call, msg in (
        (lambda: st.add_request("b", [1], [2], True), r"request 'b': state_id: expected an int, got True"),
        (lambda: st.add_request("b", [1], [2], 1.5), r"request 'b': state_id: expected an int, got 1.5"),
        (lambda: st.add_request("b", [1], [2], 1, num_computed=np.float32(1)), r"request 'b': num_computed"),
        (lambda: st.add_request("b", [1.5], [2], 1), r"request 'b': prompt_token_ids: expected ints, got float64"),
        (lambda: st.add_request("b", [1], [True], 1), r"request 'b': block_table: expected ints, got bool"),
        (lambda: st.set_state_id(a, 2.0), r"request 'a': state_id: expected an int"),
        (lambda: st.set_swa_valid_start(a, False), r"request 'a': swa_valid_start: expected an int"),
        (lambda: st.append_tokens(True, [4]), r"slot: expected an int, got True"),
        (lambda: st.append_tokens(1.0, [4]), r"slot: expected an int, got 1.0"),
        (lambda: st.append_tokens(a, [4.5]), r"request 'a': tokens: expected ints, got float64"),
        (lambda: st.append_tokens_batch(np.array([0.0]), np.array([4]), np.array([1])), r"slots: expected ints"),
        (lambda: st.decode_batch(np.array([a]), num_placeholders=True), r"num_placeholders: expected an int"),
        (lambda: st.decode_batch(np.array([a]), num_placeholders=2**31),  # (was a MemoryError from the gather)
         r"num_placeholders: expected <= 65536 \(rows padding one batch\), got 2147483648"),
        (lambda: st.prompt_batch(np.array([a]), np.array([1]), num_placeholders=np.int64(65537)),
         r"num_placeholders: expected <= 65536"),
        (lambda: st.decode_batch(np.array([a]), np.array([1.5]), 1), r"draft_tokens: expected ints"),
        (lambda: st.decode_batch(np.array([a]), np.array([5]), np.array([1.0])), r"num_drafts: expected 1 counts"),
        (lambda: st.prompt_batch(np.array([a]), np.array([1.0])), r"chunk_lens: expected ints"),
        (lambda: st.prompt_batch(np.array([a]), np.array([1]), advance="no"),  # (was taken as True)
         r"advance: expected a bool, got 'no'"),
        (lambda: st.request_of(-1), r"slot: expected a slot in \[0, \d+\), got -1"),  # (was the last slot's)
        (lambda: st.state_holder(1.5), r"state_id: expected an int, got 1.5"),
    ):
        _refused(st, call, (TypeError, ValueError), msg)


@pytest.mark.parametrize("kw,err", [
    ({"max_seqs": 1.5}, "TypeError: max_seqs: expected an int, got 1.5"),  # (was taken as 1)
    ({"max_seqs": True}, "TypeError: max_seqs: expected an int, got True"),
    ({"max_seqs": None}, "TypeError: max_seqs: expected an int, got None"),
    ({"max_seqs": 0}, "ValueError: max_seqs: expected >= 1, got 0"),
    ({"max_tokens": -5}, "ValueError: max_tokens: expected >= 1, got -5"),  # (numpy's "negative dimensions")
    ({"max_tokens": 0}, "ValueError: max_tokens: expected >= 1, got 0"),
    ({"max_blocks": 2.0}, "TypeError: max_blocks: expected an int, got 2.0"),
    ({"max_compressed": -1}, "ValueError: max_compressed: expected >= 0, got -1"),
])
def test_batch_state_capacities_are_checked_by_name(kw: dict, err: str) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        BatchState(SWA, kw.pop("max_seqs", 2), **kw)
    assert f"{info.type.__name__}: {info.value}" == err


def test_a_state_too_large_to_allocate_names_its_capacities() -> None:
    with pytest.raises(MemoryError, match=r"BatchState: max_seqs=1099511627776 slots of max_tokens=\d+, max_blocks="):
        BatchState(SWA, 2**40)


def test_a_decode_batch_of_no_slots_refuses_drafts() -> None:
    """No slots and some drafts: the draft counts' error (the refused step's empty buffer was
    taken for a batch of no rows, and reading its offsets raised ``IndexError``); no slots and no
    drafts is a batch of no rows."""
    st = BatchState(SWA, max_seqs=2)
    st.add_request("a", [1, 2, 3], [1], 0, num_computed=3)
    none = np.zeros(0, np.int64)
    for drafts, count in ((np.array([5, 6]), 2), (np.array([5, 6]), 0), (np.array([5]), np.zeros(0, np.int64))):
        _refused(st, lambda: st.decode_batch(none, drafts, count), ValueError,
                 r"num_drafts: expected 0 counts >= 0 \(or one count for all\) summing to \d drafts")
    assert st.decode_batch(none, none, 2).seqlen_q.tolist() == []


# ---- seqlen_k, int32 overflow, blocks_needed ---------------------------------------------------


@pytest.mark.parametrize("k", [-5, 0])
def test_bad_seqlen_k_is_a_seqlen_k_error(k: int) -> None:
    for is_prompt in (True, False):
        seqs = [_p(0) if is_prompt else _d(0), SequenceMetadata(1, k, [1], 1, [1])]
        with pytest.raises(ValueError, match=re.escape("seqs[1].seqlen_k: expected >= 1")):
            validate_batch(seqs, SWA, is_prompt=is_prompt)
        with pytest.raises(ValueError, match=re.escape("seqs[1].seqlen_k")):
            (prepare_prompt if is_prompt else prepare_decode)(seqs, SWA)


@pytest.mark.parametrize("is_prompt", [True, False], ids=["prompt", "decode"])
def test_int32_overflow_names_the_sequence(is_prompt: bool) -> None:
    make = _p if is_prompt else _d
    # SWA: S = 4, max_state_id = (2**31 - 4) // 4; block ids: b_c = 16 // 4 = 4, same bound
    top = (2**31 - 4) // 4
    assert SWA.max_state_id == SWA.max_block_id == top
    for seqs, field, what, paths in (
        ([make(0), make(top + 1)], "state_id", "slot_mapping_store_swa int32 overflow", (0, 1, 2, 3)),
        # block ids are values the builders read: the list and the SequenceBatch path
        ([make(0), make(1, table=[top + 1, 3])], "block_table", "slot_mapping_store_ca int32 overflow", (1, 3)),
    ):
        calls = _all_inputs(seqs, SWA, is_prompt)
        for call in (calls[p] for p in paths):
            with pytest.raises(ValueError, match=re.escape(f"seqs[1].{field}: expected ") + f".*{re.escape(what)}"):
                call()
    build = prepare_prompt if is_prompt else prepare_decode
    build([make(top), make(1, table=[top, 3])], SWA)  # the bound itself fits
    # without the state cache a state id is read by nothing: only int64 bounds it
    (prepare_prompt if is_prompt else prepare_decode)([make(2**40)], PLAIN)
    with pytest.raises(ValueError, match=re.escape("seqs[0].state_id: expected an int within int64")):
        (prepare_prompt if is_prompt else prepare_decode)([make(2**63)], PLAIN)


def test_blocks_needed_refuses_floats_and_negative_counts() -> None:
    with pytest.raises(ValueError, match=r"seqlen_k: expected >= 0, got -5"):
        blocks_needed(-5, SWA)
    for bad in (17.5, 17.0, True, "17", None):
        with pytest.raises(TypeError, match=r"seqlen_k: expected an int"):
            blocks_needed(bad, SWA)  # type: ignore[arg-type]
    assert blocks_needed(0, SWA) == 0 and blocks_needed(np.uint32(17), SWA) == 1
    assert type(blocks_needed(np.int64(300), MetadataConfig.compressed_swa())) is int


def test_a_wrong_config_or_flag_is_named_before_it_is_used() -> None:
    """Each of these failed on an attribute the object lacks (``'NoneType' object has no attribute
    'max_ngram_size'``), an overflow, or was taken by its truth."""
    import cpmeta

    cfg = MetadataConfig(block_size=4, max_model_len=64)
    st = BatchState(cfg, 2)
    a = st.add_request("a", [1, 2, 3], [1], 0, num_computed=3)
    batch = st.decode_batch(np.array([a]))
    md = cpmeta.prepare(batch, cfg)
    for call, err, msg in (
            (lambda: cpmeta.prepare(batch, None), TypeError, "cfg: expected a MetadataConfig, got NoneType"),
            (lambda: prepare_decode([], "cfg"), TypeError, "cfg: expected a MetadataConfig, got str"),
            (lambda: BatchState({"block_size": 4}, 2), TypeError, "cfg: expected a MetadataConfig, got dict"),
            (lambda: md.compute_attn_info(None), TypeError, "cfg: expected a MetadataConfig"),
            (lambda: cpmeta.prepare(batch, cfg, is_prompt="no"), TypeError,
             "is_prompt: expected a bool or None, got 'no'"),
            (lambda: cpmeta.OutputArenas(float("inf")), TypeError, "max_shapes: expected an int, got inf"),
            (lambda: cpmeta.cp_kv_read_plan(md, cfg, cp_rank=2**63), ValueError,
             re.escape("cp_rank: expected 0 <= cp_rank < 2**31, got 9223372036854775808"))):
        with pytest.raises(err, match=msg):
            call()
    assert cpmeta.prepare(batch, cfg, is_prompt=np.bool_(False)).num_seqs == 1


def _group_and_device(rank: int, world: int) -> list[str]:
    import torch

    import cpmeta
    from cpmeta.transport import ObjectChannel, TensorChannel

    cfg = MetadataConfig(block_size=4, max_model_len=64)
    out = []
    makers = (lambda **kw: cpmeta.MetadataBroadcaster(**kw), lambda **kw: cpmeta.ReplicatedBatchState(cfg, 2, **kw),
              lambda **kw: ObjectChannel(**kw), lambda **kw: TensorChannel(**kw),
              lambda **kw: cpmeta.broadcast_tensor_dict({"a": 1}, **kw))
    cuda = f"cuda:{torch.cuda.device_count()}"  # one past this process's CUDA devices (or the first of none)
    for make in makers:
        for kw in ({"group": "world"}, {"group": 0}, {"device": "x"}, {"device": "meta"}, {"device": cuda}):
            if "device" in kw and make in makers[2:3]:
                continue  # (an ObjectChannel moves bytes: it has no device)
            try:
                make(**kw)
                out.append("made")
            except (TypeError, ValueError) as e:
                out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_wrong_group_or_device_is_named_by_every_constructor() -> None:
    """``group="world"`` was a ``KeyError`` of torch's group lookups (an ``AttributeError`` in
    ``broadcast_tensor_dict``); ``device="x"`` torch's list of device types, ``"meta"`` a later
    failure, a CUDA device this process lacks a pinned-memory or device-query ``RuntimeError``."""
    from cpmeta.testing import run_ranks

    (out,) = run_ranks(_group_and_device, 1, timeout=120)
    group = "TypeError: group: expected a torch.distributed ProcessGroup or None, got "
    dev = "ValueError: device: expected a CPU or CUDA device ('cpu', 'cuda:0', a torch.device), got "
    import torch
    n = torch.cuda.device_count()
    want = [group + "str", group + "int", dev + "'x'", dev + "'meta'",
            f"ValueError: device: cuda:{n}, but this process sees {n} CUDA device(s)"]
    assert out == want * 2 + want[:2] + want * 2, out


def test_cp_and_staging_helpers_name_a_wrong_argument() -> None:
    """Each was an ``AttributeError`` of the object passed, an overflow or torch's own error."""
    import torch

    import cpmeta.cp as cp
    from cpmeta.gpu import DecodeStaging, prepare_decode_inplace

    cfg = MetadataConfig(block_size=4, max_model_len=64)
    st = BatchState(cfg, 2)
    a = st.add_request("a", [1, 2, 3], [1], 0, num_computed=3)
    md = prepare_decode(st.decode_batch(np.array([a])), cfg)
    for call, err, msg in (
            (lambda: cp.compute_slot_mapping_from_metadata(md, "16"), TypeError,
             "block_size: expected an int or the MetadataConfig the metadata was built with, got str"),
            (lambda: cp.compute_slot_mapping_from_metadata({"positions": 1}, 16), TypeError,
             r"md: expected InputMetadata \(or a view of it\), got dict"),
            (lambda: cp.cp_local_seqlens(torch.tensor([5]), 2**63, 0, 16), ValueError,
             r"cp_world_size: expected 1 <= cp_world_size < 2147483648, got 9223372036854775808"),
            (lambda: cp.cp_local_seqlens(torch.tensor([5]), 2, 0, 2**63), ValueError, "cp_interleave: expected"),
            (lambda: DecodeStaging("cpu", -1), ValueError, r"capacity: expected >= 0 \(int32 elements\), got -1"),
            (lambda: DecodeStaging("x"), ValueError, "device: expected a CPU or CUDA device"),
            (lambda: DecodeStaging(f"cuda:{torch.cuda.device_count()}"), ValueError, "CUDA device"),
            (lambda: prepare_decode_inplace(st.decode_batch(np.array([a])), cfg, device="x"), ValueError,
             "device: expected a CPU or CUDA device"),
            (lambda: prepare_decode_inplace(st.decode_batch(np.array([a])), cfg, device="cpu", staging="cpu"),
             TypeError, "staging: expected a cpmeta.gpu.DecodeStaging, got str")):
        with pytest.raises(err, match=msg):
            call()
