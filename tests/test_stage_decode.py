"""``BatchState.stage_decode`` (docs/design.md sections 12 + 13): the decode staging buffer written straight from the
state arrays must be what ``DecodeStaging.stage(state.decode_batch(...))`` writes.

- random engines (several configs, several ratio sets, drafts, placeholders, Engram through the
  fallback): staging bytes and ``StagedDecode`` identical, and the metadata after the kernels
  (torch emulation; the real Triton kernels under ``TRITON_INTERPRET=1`` in a subprocess) equals
  ``prepare_decode(state.decode_batch(...))`` on every defined field, also through
  ``launch_decode_inplace`` on captured-size buffers;
- capacity refusals (q_cap / seq_cap / block columns, fixed staging) fire before the host buffer
  changes; invalid batches raise the builders' own messages (fallback path).
"""

from __future__ import annotations

import importlib.util
import random
import re
import sys

import numpy as np
import pytest
import torch

from cpmeta import BatchState, MetadataConfig, SequenceBatch, prepare_decode
from cpmeta.diff import metadata_diff
from cpmeta.gpu.decode_inplace import DecodeStaging, launch_decode_inplace, prepare_decode_inplace
from cpmeta.gpu.decode_inplace import finish_staged
from cpmeta.sequence import blocks_needed
from cpmeta.gpu import decode_staging
from cpmeta.gpu.decode_staging import stage_decode
from cpmeta.gpu.decode_cp import check_staged_layout
from cpmeta.gpu.staging_layout import StagedDecode, StagingLayout, unpack_staging
from strategies import metadata_prefix

HAS_TRITON = importlib.util.find_spec("triton") is not None

CONFIGS = [
    MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                   sparse_compress_ratios=(4, 8), max_model_len=96),
    MetadataConfig(block_size=32, window_size=8, swa_block_size=8, dense_compress_ratios=(1, 8),
                   sparse_compress_ratios=(), max_model_len=200),
    MetadataConfig(block_size=8, window_size=3, swa_block_size=5, dense_compress_ratios=(),
                   sparse_compress_ratios=(2, 8), max_model_len=64),
    MetadataConfig(block_size=128, window_size=16, swa_block_size=16, dense_compress_ratios=(4, 128),
                   sparse_compress_ratios=(4,), max_model_len=512),
    # Engram: served by the decode_batch + stage fallback
    MetadataConfig(block_size=16, window_size=4, swa_block_size=6, dense_compress_ratios=(4,),
                   sparse_compress_ratios=(4, 8), max_model_len=96, max_ngram_size=3, image_token_id=5),
    # docs/design.md section 14: a plain paged-KV model, and its KV sharded over 3 ranks in runs of 4 (tables of
    # rank 0's share); the staging header then holds no ratio at all
    MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                   max_model_len=96),
    MetadataConfig(block_size=8, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                   max_model_len=200, kv_cp_world_size=3, kv_cp_interleave=4),
]
#: Indices in CONFIGS of the Engram config and of the plain one (other tests pick them).
ENGRAM_CI, PLAIN_CI = 4, 5


def assert_same_staged(fast: DecodeStaging, got: StagedDecode, slow: DecodeStaging, want: StagedDecode,
                       cfg: MetadataConfig) -> None:
    """``stage_decode``'s buffer describes the same batch as ``decode_batch`` + ``stage``'s: equal
    scalars but ``used``, equal header / per-sequence rows / input ids / each sequence's defined
    block ids (``unpack_staging``), wherever the tables sit; and a follower would accept it."""
    assert got._replace(used=0) == want._replace(used=0)
    a, b = fast.host_buffer[:got.used].numpy(), slow.host_buffer[:want.used].numpy()
    assert check_staged_layout(a, got, cfg) is None
    u, v = unpack_staging(a, got, cfg), unpack_staging(b, want, cfg)
    assert u["sizes"] == v["sizes"]
    for key in ("seq", "ids"):
        assert np.array_equal(u[key], v[key]), key
    assert len(u["tables"]) == len(v["tables"]) and all(np.array_equal(x, y) for x, y in zip(u["tables"], v["tables"]))
    assert all(np.array_equal(x, y) for x, y in zip(u["ngram"], v["ngram"]))


def stage_both(st: BatchState, fast: DecodeStaging, slow: DecodeStaging, slots: np.ndarray, drafts: np.ndarray,
               counts: np.ndarray, n_ph: int, cfg: MetadataConfig) -> tuple[SequenceBatch, StagedDecode]:
    """Stage one step both ways (``stage_decode`` into ``fast``; ``decode_batch`` + ``stage`` into
    ``slow``), assert they describe the same batch; returns ``(batch, staged)``."""
    batch = st.decode_batch(slots, drafts, counts, num_placeholders=n_ph)
    want = slow.stage(batch, cfg)
    got = stage_decode(fast, st, slots, drafts, counts, num_placeholders=n_ph)
    assert_same_staged(fast, got, slow, want, cfg)
    return batch, got


def _engine(cfg: MetadataConfig, rng: random.Random, max_seqs: int = 6, uniform: int = -1):
    """A state with ``max_seqs`` decoding requests and a step generator: each yields
    ``(slots, drafts, counts, n_ph)`` then applies the accepted tokens (and new blocks).
    ``uniform >= 0``: every request of a step has that many drafts (the common MTP step)."""
    st = BatchState(cfg, max_seqs=max_seqs)
    lens = {}
    held: set[int] = set()
    for i in range(max_seqs):
        n = rng.randint(1, cfg.max_model_len // 2)
        comp = [rng.randrange(100, 200) for _ in range(rng.randint(0, n))] if cfg.max_ngram_size else []
        toks = [rng.randrange(8) for _ in range(n)]
        table = [rng.randrange(1000) for _ in range(blocks_needed(n, cfg) + rng.choice((0, 1)))]
        sid = rng.randrange(50)
        while sid in held:  # live requests hold distinct state slots (the next free one)
            sid = (sid + 1) % 50
        held.add(sid)
        s = st.add_request(i, toks, table, sid, num_computed=n, compressed_token_ids=comp)
        lens[s] = n

    def steps(k: int):
        for _ in range(k):
            live = [s for s in lens if lens[s] < cfg.max_model_len - 4]
            if not live:
                return
            slots = np.array(rng.sample(live, rng.randint(1, len(live))))
            counts = np.array([rng.choice((0, 0, 1, 2, 3)) if uniform < 0 else uniform for _ in slots])
            for s, c in zip(slots, counts):
                have, need = int(st.num_blocks[s]), blocks_needed(lens[int(s)] + int(c), cfg)
                if need > have:
                    st.append_blocks(int(s), [rng.randrange(1000) for _ in range(need - have)])
            drafts = np.array([rng.randrange(8) for _ in range(int(counts.sum()))], np.int64)
            yield slots, drafts, counts, rng.choice((0, 0, 1, 3))
            acc = np.array([rng.randint(1, int(c) + 1) for c in counts])
            st.append_tokens_batch(slots, np.array([rng.randrange(8) for _ in range(int(acc.sum()))]), acc)
            for s, a in zip(slots, acc):
                lens[int(s)] += int(a)

    return st, steps


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_matches_decode_batch_and_stage(ci: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = CONFIGS[ci]
    slow_calls = []
    real_slow = decode_staging._slow
    monkeypatch.setattr(decode_staging, "_slow", lambda *a: slow_calls.append(1) or real_slow(*a))
    rng = random.Random(ci)
    st, steps = _engine(cfg, rng)
    fast, slow = DecodeStaging("cpu", 8), DecodeStaging("cpu", 8)  # tiny: grows on the way
    n_steps = 0
    for slots, drafts, counts, n_ph in steps(25):
        batch, got = stage_both(st, fast, slow, slots, drafts, counts, n_ph, cfg)
        fill_only = DecodeStaging("cpu", 8)  # upload=False: the same host bytes, nothing uploaded
        assert stage_decode(fill_only, st, slots, drafts, counts, num_placeholders=n_ph, upload=False) == got
        assert torch.equal(fill_only.host_buffer[:got.used], fast.host_buffer[:got.used])
        assert fill_only.last_staged is None
        md = finish_staged(fast, got, cfg, out=None, device=torch.device("cpu"), backend="torch")
        assert metadata_diff(md, prepare_decode(batch, cfg, table_width=cfg.max_num_blocks), cfg=cfg) == []
        n_steps += 1
    assert n_steps >= 10
    assert len(slow_calls) == (2 * n_steps if cfg.max_ngram_size else 0)  # Engram: the fallback only (x2: upload=False too)


@pytest.mark.parametrize("k", [1, 3, 5])  # 5: the 2-D draft write
def test_uniform_draft_counts(k: int) -> None:
    """Every request with the same number of drafts (the reshaped fast case of ``stage_decode`` and
    of the fast decode batch): the same staged batch as ``decode_batch`` + ``stage``, same metadata;
    also with the count given once (``num_drafts=k``) and with int32 draft ids."""
    for ci, cfg in enumerate(CONFIGS[:4]):
        st, steps = _engine(cfg, random.Random(10 + ci), uniform=k)
        fast, slow, other = DecodeStaging("cpu", 8), DecodeStaging("cpu", 8), DecodeStaging("cpu", 8)
        n_steps = 0
        for slots, drafts, counts, n_ph in steps(12):
            batch, got = stage_both(st, fast, slow, slots, drafts, counts, n_ph, cfg)
            # ONE count for all and int32 ids (no range check): the same bytes
            for d, c in ((drafts, k), (drafts.astype(np.int32), counts), (drafts.astype(np.int32), np.int64(k))):
                assert stage_decode(other, st, slots, d, c, num_placeholders=n_ph) == got
                assert torch.equal(other.host_buffer[:got.used], fast.host_buffer[:got.used])
                assert metadata_diff(prepare_decode(st.decode_batch(slots, d, c, num_placeholders=n_ph), cfg),
                                     prepare_decode(batch, cfg), cfg=cfg) == []
            n_steps += 1
        assert n_steps >= 6, (cfg, n_steps)


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_state_writer_writes_every_staged_word(k: int) -> None:
    """The common step (no placeholders, one draft count for all), staged over a poisoned host
    buffer, after other shapes and after the staging grew (tiny buffers): byte for byte what a
    fresh staging buffer holds -- the compiled writer leaves no stale word in ``[0, used)``."""
    for ci in (0, 3, PLAIN_CI):
        cfg = CONFIGS[ci]
        st, steps = _engine(cfg, random.Random(30 + ci), uniform=k)
        fast = DecodeStaging("cpu", 8)
        for slots, drafts, counts, _ in steps(12):
            step = st.vouch_decode(slots, drafts, counts)
            assert step is not None and step.uniform
            for poison in (False, True):  # the second call: the same step over junk
                if poison:
                    fast.host_buffer.fill_(-7)
                got = stage_decode(fast, st, slots, drafts, counts)
                ref = DecodeStaging("cpu", got.used)
                assert stage_decode(ref, st, slots, drafts, counts) == got
                assert torch.equal(fast.host_buffer[:got.used], ref.host_buffer[:got.used]), (ci, k)


def test_state_writer_reads_the_state_after_long_tables_moves_and_reuse() -> None:
    """``stage_decode`` copies from the state's own arrays, cast to int32 as it writes: a table
    longer than ``max_num_blocks`` (its first ``max_num_blocks`` ids staged), a moved state id, a
    finished request's slot reused by a shorter table (the old ids still in the row past the new
    table are never staged: -1 there). Each step's table section is each table's first ids, then
    -1, and the staged batch is ``decode_batch`` + ``stage``'s."""
    cfg = CONFIGS[0]
    mnb = cfg.max_num_blocks

    def table_rows(stg: DecodeStaging, got: StagedDecode) -> list[list[int]]:
        buf = stg.host_buffer[:got.used].numpy()
        off_bt = int(buf[5])  # header word H_OFF_BT
        return buf[off_bt:off_bt + got.num_seqs * mnb].reshape(got.num_seqs, mnb).tolist()

    st = BatchState(cfg, max_seqs=2, max_blocks=mnb + 3)
    a = st.add_request("a", [1, 2, 3], [9] * (mnb - 1), 0, num_computed=3)
    b = st.add_request("b", [4], [5, 6], 1, num_computed=1)
    st.append_blocks_batch(np.array([a]), np.array([7, 8, 9]), np.array([3]))  # past max_num_blocks
    st.append_tokens_batch(np.array([b, a]), np.array([11, 12, 13]), np.array([2, 1]))
    st.set_state_id(b, 7)
    fast, slow = DecodeStaging("cpu", 8), DecodeStaging("cpu", 8)
    none = np.zeros(0, np.int64)
    batch, got = stage_both(st, fast, slow, np.array([a, b]), none, np.zeros(2, np.int64), 0, cfg)
    assert table_rows(fast, got) == [[9] * (mnb - 1) + [7], [5, 6] + [-1] * (mnb - 2)]
    assert batch.tokens.tolist() == [13, 12] and batch.state_id.tolist() == [0, 7]
    st.finish(a)
    c = st.add_request("c", [4, 4], [3], 2, num_computed=2)
    assert c == a and st.block_table[c, 1] == 9  # the old table is still in the row
    batch, got = stage_both(st, fast, slow, np.array([c]), none, np.zeros(1, np.int64), 0, cfg)
    assert table_rows(fast, got) == [[3] + [-1] * (mnb - 1)]


def test_launch_and_replay_shape_unchanged() -> None:
    """Buffers captured at a larger batch: ``launch_decode_inplace`` after ``stage_decode`` gives
    ``prepare_decode`` on the live prefix."""
    cfg = CONFIGS[0]
    rng = random.Random(7)
    st, steps = _engine(cfg, rng)
    stg = DecodeStaging("cpu", 4096, fixed=True)
    out: dict[str, torch.Tensor] = {}
    all_slots = np.flatnonzero(st.active)
    prepare_decode_inplace(st.decode_batch(all_slots, np.zeros(3 * len(all_slots), np.int64),
                                           np.full(len(all_slots), 3), num_placeholders=3),
                           cfg, out=out, device="cpu", backend="torch", staging=stg)
    for slots, drafts, counts, n_ph in steps(10):
        batch = st.decode_batch(slots, drafts, counts, num_placeholders=n_ph)
        staged = stage_decode(stg, st, slots, drafts, counts, num_placeholders=n_ph)
        md = launch_decode_inplace(stg, cfg, out=out, backend="torch")
        got = metadata_prefix(md, staged.num_seqs, staged.total_q)
        assert metadata_diff(got, prepare_decode(batch, cfg, table_width=cfg.max_num_blocks), cfg=cfg) == []


def test_capacity_refusals_before_any_write() -> None:
    cfg = CONFIGS[0]
    st = BatchState(cfg, 4)
    for i in range(3):
        st.add_request(i, list(range(10)), [1, 2, 3], i, num_computed=10)
    stg = DecodeStaging("cpu", 4096)
    out: dict[str, torch.Tensor] = {}
    slots = np.array([0, 1])  # captured: 2 sequences, 6 rows
    prepare_decode_inplace(st.decode_batch(slots, np.arange(4), np.array([2, 2])), cfg, out=out, device="cpu",
                           backend="torch", staging=stg)
    before = stg.host_buffer.clone()
    with pytest.raises(ValueError, match="q_cap=6"):
        stage_decode(stg, st, slots, np.arange(5), np.array([3, 2]))
    with pytest.raises(ValueError, match="seq_cap=2"):
        stage_decode(stg, st, np.array([0]), num_placeholders=2)
    with pytest.raises(ValueError, match="seq_cap=2"):
        stage_decode(stg, st, np.array([0, 1, 2]))
    assert torch.equal(stg.host_buffer, before)
    # block columns: buffers captured under a config with a shorter max_model_len
    short = MetadataConfig(block_size=4, window_size=2, swa_block_size=2, dense_compress_ratios=(4,),
                           sparse_compress_ratios=(), max_model_len=64)
    long = MetadataConfig(block_size=4, window_size=2, swa_block_size=2, dense_compress_ratios=(4,),
                          sparse_compress_ratios=(), max_model_len=128)
    stg2, out2 = DecodeStaging("cpu", 4096), {}
    small = BatchState(short, 1)
    prepare_decode_inplace(small.decode_batch(np.array([small.add_request("a", [1, 2], [5], 0, num_computed=2)])),
                           short, out=out2, device="cpu", backend="torch", staging=stg2)
    bs = BatchState(long, 1)
    b = bs.add_request("b", list(range(68)), list(range(17)), 1, num_computed=68)
    with pytest.raises(ValueError, match=rf"block_tables: 17 columns exceed the captured buffers' "
                                         rf"bt_cols={short.max_num_blocks}"):
        stage_decode(stg2, bs, np.array([b]))
    # a fixed staging buffer too small: the fill's own message
    with pytest.raises(ValueError, match="fixed staging buffer holds 8"):
        stage_decode(DecodeStaging("cpu", 8, fixed=True), st, slots)


def test_invalid_batches_raise_the_builders_messages() -> None:
    cfg = CONFIGS[0]
    st, _ = _engine(cfg, random.Random(5))
    slots = np.array([0, 1])
    for call in (lambda s, x: stage_decode(x, s, slots), lambda s, x: x.stage(s.decode_batch(slots), cfg)):
        st.set_state_id(1, -1)
        with pytest.raises(ValueError, match=r"seqs\[1\]\.state_id"):
            call(st, DecodeStaging("cpu"))
        st.set_state_id(1, 0)
    with pytest.raises(ValueError, match="slots"):
        stage_decode(DecodeStaging("cpu"), st, np.array([0, 99]))
    with pytest.raises(ValueError, match="num_drafts"):
        stage_decode(DecodeStaging("cpu"), st, slots, np.array([1, 2]), np.array([1, 0]))
    for bad in (-1, 2, True):  # one count for all: negative, not adding up, a bool is not a count
        for call in (lambda: stage_decode(DecodeStaging("cpu"), st, slots, np.array([1, 2]), bad),
                     lambda: st.decode_batch(slots, np.array([1, 2]), bad)):
            with pytest.raises(ValueError, match=r"num_drafts: expected 2 counts >= 0 \(or one count for all\)"):
                call()
    for bad, kind in ((1.5, TypeError), (True, TypeError), (-1, ValueError), (2**31, ValueError)):  # as decode_batch
        with pytest.raises(kind, match="num_placeholders: expected"):
            stage_decode(DecodeStaging("cpu"), st, slots, num_placeholders=bad)
    # a negative block id inside the needed prefix: the fallback's message
    bad = BatchState(cfg, 2)
    s = bad.add_request("x", list(range(20)), [4, -1], 0, num_computed=20)
    with pytest.raises(ValueError, match="block_table"):
        stage_decode(DecodeStaging("cpu"), bad, np.array([s]))
    with pytest.raises(ValueError, match="block_table"):
        DecodeStaging("cpu").stage(bad.decode_batch(np.array([s])), cfg)


def test_int32_limits_and_draft_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path's own int32 bounds: past the decode-offset bound (rows * max_num_blocks *
    block_size // min dense ratio) and for draft ids past int32 it steps aside to the general
    path -- each time the same staged batch or the same error as ``decode_batch`` + ``stage``."""
    slow_calls: list[int] = []
    real_slow = decode_staging._slow
    monkeypatch.setattr(decode_staging, "_slow", lambda *a: slow_calls.append(1) or real_slow(*a))
    cfg = MetadataConfig(block_size=2**20, window_size=4, swa_block_size=8, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(), max_model_len=2**29)
    st = BatchState(cfg, max_seqs=5)
    assert (2**31 - 1) // (cfg.max_num_blocks * (cfg.block_size // 4)) == 15  # 512 columns * 2**18 a row
    for i in range(5):
        st.add_request(i, [1] * (5 + i), [i], i, num_computed=5 + i)

    def both(slots: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> None:
        fast, slow = DecodeStaging("cpu", 8), DecodeStaging("cpu", 8)
        try:
            want = slow.stage(st.decode_batch(slots, drafts, counts), cfg)
        except ValueError as e:
            with pytest.raises(ValueError, match=re.escape(str(e))):
                stage_decode(fast, st, slots, drafts, counts)
            return
        assert_same_staged(fast, stage_decode(fast, st, slots, drafts, counts), slow, want, cfg)

    both(np.arange(5), np.arange(10), np.full(5, 2))  # 15 rows: fast
    assert slow_calls == []
    both(np.arange(4), np.arange(12), np.full(4, 3))  # 16 rows * 2**27 > INT32_MAX: general path
    assert len(slow_calls) == 1
    both(np.arange(2), np.array([5, -7]), np.array([1, 1]))  # negative: not vouched, the general path names it
    assert len(slow_calls) == 2
    both(np.arange(2), np.array([5, 2**31]), np.array([1, 1]))  # past int32: the general path
    assert len(slow_calls) == 3


@pytest.mark.parametrize("max_model_len", [4096, 2**21 + 1, 2**29])
def test_blocks_of_equals_blocks_needed(max_model_len: int) -> None:
    """The follower's check gathers ``blocks_needed`` from a table of every length while that
    table is small, and computes it past ``NEED_TABLE_MAX`` (a 2**29 table would be 4 GiB):
    either way every length's ``blocks_needed``, sharded KV included."""
    from cpmeta.gpu.staging_layout import NEED_TABLE_MAX

    compressed = dict(window_size=4, swa_block_size=8, dense_compress_ratios=(4,), sparse_compress_ratios=())
    sharded = dict(window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(), kv_cp_world_size=3,
                   kv_cp_interleave=2)  # the KV sharded like the CP group (plain attention only)
    for kw in (compressed, sharded):
        cfg = MetadataConfig(block_size=16, max_model_len=max_model_len, **kw)
        k = np.unique(np.r_[0, 1, 15, 16, 17, 63, 64, 65, np.random.default_rng(0).integers(0, max_model_len + 1, 200),
                            max_model_len])
        got = StagingLayout.of(cfg).blocks_of(k)
        assert got.tolist() == [blocks_needed(int(v), cfg) for v in k]
    assert (max_model_len > NEED_TABLE_MAX) == (StagingLayout.of(cfg)._need is None)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_kernels_in_interpreter() -> None:
    from triton_interpret import run_interpreted

    run_interpreted(__file__, "interpreter steps passed")


def _interpreter_main() -> None:
    n = 0
    for ci, cfg in enumerate(CONFIGS):
        st, steps = _engine(cfg, random.Random(100 + ci))
        stg = DecodeStaging("cpu")
        for slots, drafts, counts, n_ph in steps(3):
            batch = st.decode_batch(slots, drafts, counts, num_placeholders=n_ph)
            staged = stage_decode(stg, st, slots, drafts, counts, num_placeholders=n_ph)
            md = finish_staged(stg, staged, cfg, out=None, device=torch.device("cpu"), backend="triton")
            assert metadata_diff(md, prepare_decode(batch, cfg, table_width=cfg.max_num_blocks), cfg=cfg) == [], (ci, n)
            n += 1
    print(f"{n} interpreter steps passed")


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        _interpreter_main()


def test_upload_in_graph_needs_a_capture() -> None:
    """``upload_in_graph`` outside a CUDA capture (here: a CPU staging) is refused; on CPU
    ``replay_uploading`` is the plain replay, with the batch's scalars recorded."""
    st = DecodeStaging("cpu", 64, fixed=True)
    with pytest.raises(ValueError, match="while capturing a CUDA graph"):
        st.upload_in_graph()
    calls = []

    class _Graph:
        def replay(self) -> None:
            calls.append(1)

    st.replay_uploading(_Graph(), "scalars")  # type: ignore[arg-type]
    assert calls == [1] and st.last_staged == "scalars"
