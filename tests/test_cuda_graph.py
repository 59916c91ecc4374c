"""CUDA-graph replay of decode metadata (docs/design.md sections 6 and 12). GPU only: skips without CUDA.

1. In-place path: capture ``launch_decode_inplace`` (the Triton metadata + block-table kernels),
   ``compute_attn_info`` and a small consumer (a gather through ``kv_ca_index`` and
   ``kv_swa_index``) at the maximum batch; then, per step, reset the ``get_clean_list()`` fields,
   stage a smaller random batch (``DecodeStaging.stage``: refill + ONE H2D copy, outside the
   graph) and replay. Every replay's rows ``[0, total_q)`` equal a fresh eager
   ``prepare_decode`` + ``compute_attn_info`` + consumer; tail rows are inert.
2. Copy path: capture ``compute_attn_info`` + consumer on static device metadata, then feed each
   step's freshly built CPU metadata (padded to the captured shape with placeholder sequences)
   through ``recursive_copy_`` and replay.
3. Capacity: a graph captured for 4 sequences x 2 rows fed by a staging buffer for 64: batches one
   row / one sequence / one block-table column too large are refused by ``stage()`` before the
   copy and the buffers stay untouched across replays. Streams: ``DecodeStaging.replay(g, side)``
   orders a replay on another stream after the upload and before the next one (delays injected
   with ``torch.cuda._sleep`` on each side).
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any, Callable

import pytest
import torch

from cpmeta.config import MetadataConfig
from cpmeta.constants import PAD_SLOT_ID
from cpmeta.builders.decode import prepare_decode
from cpmeta.gpu.decode_inplace import (
    DecodeStaging, capture_decode_graph, launch_decode_inplace, prepare_decode_inplace, staging_capacity,
)
from cpmeta.diff import metadata_diff
from cpmeta.gpu.decode_staging import stage_decode
from cpmeta.metadata import InputMetadata
from cpmeta.sequence import SequenceMetadata, blocks_needed
from strategies import metadata_prefix, random_decode_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU"),
]
HAS_TRITON = importlib.util.find_spec("triton") is not None

N_CAP = 24  # sequences the graph is captured for
Q_CAP = 3 * N_CAP  # rows (up to 2 drafts per sequence)
STEPS = 12
KV_SLOTS = 1 << 16  # size of the fake KV cache the consumer gathers from

CFG = MetadataConfig(
    block_size=16, window_size=24, swa_block_size=27, dense_compress_ratios=(4, 16),
    sparse_compress_ratios=(4,), max_model_len=512, max_ngram_size=2, image_token_id=5,
)


def _consumer(md: InputMetadata, kv: torch.Tensor) -> torch.Tensor:
    """[rows] int64: sum over each row of ``kv[index]`` through kv_ca_index["4"] and kv_swa_index."""
    idx = md.kv_ca_index["4"]
    ca = torch.where(idx >= 0, kv[idx.clamp(min=0).long()], 0).sum(dim=1)
    sw = md.kv_swa_index
    return ca + torch.where(sw >= 0, kv[sw.clamp(min=0).long()], 0).sum(dim=1)


def _capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up on a side stream, then capture it; returns the graph and fn's result."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = fn()
    return g, res




def _fresh(seqs: list[SequenceMetadata], kv: torch.Tensor) -> tuple[InputMetadata, torch.Tensor]:
    ref = prepare_decode(seqs, CFG, table_width=CFG.max_num_blocks).to("cuda").compute_attn_info(CFG)  # the graph's width
    return ref, _consumer(ref, kv)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_inplace_graph_replays_smaller_batches() -> None:
    rng = random.Random(0)
    kv = torch.randint(0, 1000, (KV_SLOTS,), device="cuda", dtype=torch.int64)
    st = DecodeStaging("cuda", staging_capacity(CFG, N_CAP, Q_CAP), fixed=True)
    out: dict[str, torch.Tensor] = {}
    big = _pad_to_capture(random_decode_batch(rng, CFG, n_seqs=N_CAP // 2, max_drafts=2))
    prepare_decode_inplace(big, CFG, out=out, device="cuda", staging=st)  # buffers: N_CAP / Q_CAP
    q_cap = out["positions"].shape[0]
    assert q_cap == Q_CAP and out["cu_seqlens_q"].shape[0] == N_CAP + 1
    ptrs = {k: v.data_ptr() for k, v in out.items()}

    def step() -> tuple[InputMetadata, torch.Tensor]:
        md = launch_decode_inplace(st, CFG, out=out)
        md.compute_attn_info(CFG)
        return md, _consumer(md, kv)

    graph, (md, y) = _capture(step)
    captured = {name: getattr(md, name) for name in md.get_clean_list()}
    assert all(v is not None for k, v in captured.items() if k != "kv_swa_full_index")
    for i in range(STEPS):
        seqs = random_decode_batch(rng, CFG, n_seqs=rng.randint(1, N_CAP), max_drafts=2)
        for name in md.get_clean_list():  # the engine's protocol: derived fields are re-made by the graph
            setattr(md, name, None)
        staged = st.stage(seqs, CFG)
        graph.replay()
        for name, v in captured.items():
            setattr(md, name, v)
        torch.cuda.synchronize()
        ref, y_ref = _fresh(seqs, kv)
        n, tq = staged.num_seqs, staged.total_q
        diff = metadata_diff(metadata_prefix(md, n, tq), ref, cfg=CFG)
        assert not diff, (i, diff)
        assert torch.equal(y[:tq], y_ref), i
        assert (md.slot_mapping_store_swa[tq:] == PAD_SLOT_ID).all()
        assert (md.kv_ca_index["4"][tq:] == PAD_SLOT_ID).all() and (md.kv_swa_index[tq:] == PAD_SLOT_ID).all()
        assert (y[tq:] == 0).all()
    assert {k: v.data_ptr() for k, v in out.items()} == ptrs
    assert out["positions"].shape[0] == q_cap


def _pad_to_capture(seqs: list[SequenceMetadata]) -> list[SequenceMetadata]:
    """Append placeholder sequences so the batch has exactly N_CAP sequences and Q_CAP rows."""
    n, tq = len(seqs), sum(s.seqlen_q for s in seqs)
    assert n < N_CAP and tq + (N_CAP - n) <= Q_CAP
    pads = [SequenceMetadata(1, 1, [0] * blocks_needed(1, CFG), 0, [0], is_placeholder=True)
            for _ in range(N_CAP - n - 1)]
    rest = Q_CAP - tq - len(pads)
    pads.append(SequenceMetadata(rest, rest, [0] * blocks_needed(rest, CFG), 0, [0], is_placeholder=True,
                                 draft_tokens=[0] * (rest - 1)))
    return list(seqs) + pads


def test_recursive_copy_feeds_captured_graph() -> None:
    rng = random.Random(1)
    kv = torch.randint(0, 1000, (KV_SLOTS,), device="cuda", dtype=torch.int64)
    first = _pad_to_capture(random_decode_batch(rng, CFG, n_seqs=N_CAP // 2, max_drafts=2))
    static = prepare_decode(first, CFG, table_width=CFG.max_num_blocks).to("cuda")  # a graph's fixed shapes

    def step() -> torch.Tensor:
        static.clean_derived_()
        static.compute_attn_info(CFG)
        return _consumer(static, kv)

    graph, y = _capture(step)
    ptr = static.positions.data_ptr()
    for i in range(STEPS):
        seqs = _pad_to_capture(random_decode_batch(rng, CFG, n_seqs=rng.randint(1, N_CAP // 2), max_drafts=2))
        fresh = prepare_decode(seqs, CFG, table_width=CFG.max_num_blocks).compute_attn_info(CFG)  # expanded too
        for name in fresh.get_clean_list():  # derived fields are the graph's job: never copy them
            setattr(fresh, name, None)
        static.recursive_copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        ref, y_ref = _fresh(seqs, kv)
        assert torch.equal(y, y_ref), i
        for k, v in ref.kv_ca_index.items():
            assert torch.equal(static.kv_ca_index[k], v), (i, k)
        assert torch.equal(static.kv_swa_index, ref.kv_swa_index), i
        assert static.positions.data_ptr() == ptr


# ---- capacity and streams (issue 16 item 3) ------------------------------------------------------

CAP_SEQS = 4  # the graph below is captured for 4 sequences x 2 rows; the staging holds 64 sequences


def _cap_seq(q: int, k: int, state: int, cfg: MetadataConfig = CFG) -> SequenceMetadata:
    toks = [(5 * i + 2) % 40 for i in range(k)]
    return SequenceMetadata(q, k, list(range(blocks_needed(k, cfg))), state, toks[: k - q + 1],
                            draft_tokens=toks[k - q + 1:])


def _small_graph() -> tuple[DecodeStaging, dict[str, torch.Tensor], torch.cuda.CUDAGraph]:
    st = DecodeStaging("cuda", staging_capacity(CFG, 64, 192), fixed=True)
    out: dict[str, torch.Tensor] = {}
    prepare_decode_inplace([_cap_seq(2, 30 + i, i) for i in range(CAP_SEQS)], CFG, out=out, device="cuda",
                           staging=st)
    assert out["positions"].shape[0] == 2 * CAP_SEQS and out["cu_seqlens_q"].shape[0] == CAP_SEQS + 1
    graph, _ = _capture(lambda: launch_decode_inplace(st, CFG, out=out))
    return st, out, graph


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_graph_refuses_batches_beyond_its_buffers() -> None:
    """stage() of a batch one row / one sequence / one block-table column too large (and the
    issue's 8 sequences into buffers of 4) raises before the copy; the graph keeps replaying the
    last accepted batch and the buffers' neighbours are never written."""
    st, out, graph = _small_graph()
    long_cfg = MetadataConfig(  # CFG with twice the model length: more block-table columns
        block_size=16, window_size=24, swa_block_size=27, dense_compress_ratios=(4, 16),
        sparse_compress_ratios=(4,), max_model_len=2 * CFG.max_model_len, max_ngram_size=2, image_token_id=5,
    )
    cases = [
        (CFG, [_cap_seq(1, 20 + i, i) for i in range(2 * CAP_SEQS)], "num_seqs: 8 sequences"),  # the issue
        (CFG, [_cap_seq(2, 30, 0), _cap_seq(2, 31, 1), _cap_seq(2, 32, 2), _cap_seq(3, 33, 3)],
         "total_q: 9 rows exceed the captured buffers' q_cap=8"),
        (CFG, [_cap_seq(1, 20 + i, i) for i in range(CAP_SEQS + 1)], "seq_cap=4"),
        (long_cfg, [_cap_seq(1, CFG.max_model_len + CFG.block_size, 0, long_cfg)], "bt_cols="),
    ]
    good = [_cap_seq(1, 40, 0), _cap_seq(2, 41, 1)]
    staged = st.stage(good, CFG)
    st.replay(graph)
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in out.items()}
    for cfg, seqs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            st.stage(seqs, cfg)
        st.replay(graph)
        torch.cuda.synchronize()
        assert all(torch.equal(before[k], out[k]) for k in out), msg
    md = launch_decode_inplace(st, CFG, out=out)
    torch.cuda.synchronize()
    diff = metadata_diff(metadata_prefix(md, staged.num_seqs, staged.total_q), prepare_decode(good, CFG, table_width=CFG.max_num_blocks), cfg=CFG)
    assert not diff, diff


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_replay_on_another_stream_is_ordered_with_uploads() -> None:
    """st.replay(g, side): the replay waits for an upload delayed on the current stream, and the
    next upload waits for a replay delayed on the side stream (a bare g.replay() on `side`
    would race both ways)."""
    st, out, graph = _small_graph()
    side = torch.cuda.Stream()
    rng = random.Random(4)
    for i in range(4):
        seqs = [_cap_seq(rng.randint(1, 2), rng.randint(2, 300), s) for s in range(rng.randint(1, CAP_SEQS))]
        torch.cuda._sleep(20_000_000)  # the copy below lands late on the current stream
        staged = st.stage(seqs, CFG)
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # and the replay runs late on the side stream
        st.replay(graph, side)
        st.stage([_cap_seq(1, 7, 0)], CFG)  # must not overwrite the staging before the replay read it
        torch.cuda.synchronize()
        got = {k: v.clone() for k, v in out.items()}
        ref = prepare_decode(seqs, CFG)
        tq, n = staged.total_q, staged.num_seqs
        assert torch.equal(got["positions"][:tq].cpu(), ref.positions), i
        assert torch.equal(got["slot_mapping_store_swa"][:tq].cpu(), ref.slot_mapping_store_swa), i
        assert torch.equal(got["cu_seqlens_k"][: n + 1].cpu(), ref.cu_seqlens_k), i


#: no Engram (the fast path); a plain paged-KV model (docs/design.md section 14), its KV sharded over 2 ranks too
GRAPH_STATE_CONFIGS = {
    "seed_like": dict(window_size=24, swa_block_size=27, dense_compress_ratios=(4, 16), sparse_compress_ratios=(4,)),
    "plain": dict(window_size=0, dense_compress_ratios=(), sparse_compress_ratios=()),
    "plain_kv2": dict(window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(), kv_cp_world_size=2,
                      kv_cp_interleave=4),
}


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("which", list(GRAPH_STATE_CONFIGS))
def test_graph_with_the_upload_inside_follows_a_batch_state(which: str) -> None:
    """``upload_in_graph`` + ``replay_uploading``: ONE replay copies the host staging (filled by
    ``stage_decode(staging, state, upload=False)``) and runs the kernels; every step's rows equal
    ``prepare_decode`` of the state's decode batch, with the next fill waiting for the replay."""
    import numpy as np

    from cpmeta import BatchState

    cfg = MetadataConfig(block_size=16, max_model_len=512, **GRAPH_STATE_CONFIGS[which])
    rng = random.Random(5)
    bs = BatchState(cfg, max_seqs=N_CAP)
    lens = {}
    for i in range(N_CAP):
        n = rng.randint(1, 400)
        # every table as long as the state holds (32 blocks; 16 with the KV sharded over 2 ranks)
        s = bs.add_request(i, [rng.randrange(100) for _ in range(n)], list(range(i * 40, i * 40 + bs.max_blocks)),
                           i, num_computed=n)
        lens[s] = n
    st = DecodeStaging("cuda", staging_capacity(cfg, N_CAP, Q_CAP), fixed=True)
    out: dict[str, torch.Tensor] = {}
    all_slots = np.arange(N_CAP)
    prepare_decode_inplace(bs.decode_batch(all_slots, np.zeros(2 * N_CAP, np.int64), np.full(N_CAP, 2)), cfg,
                           out=out, device="cuda", staging=st)
    graph = capture_decode_graph(st, cfg, out=out, upload=True)
    with pytest.raises(ValueError, match="while capturing"):
        st.upload_in_graph()
    for step in range(STEPS):
        slots = np.array(sorted(rng.sample(range(N_CAP), rng.randint(1, N_CAP))))
        counts = np.array([rng.choice((0, 1, 2)) for _ in slots])
        drafts = np.array([rng.randrange(100) for _ in range(int(counts.sum()))], np.int64)
        want = prepare_decode(bs.decode_batch(slots, drafts, counts), cfg, table_width=cfg.max_num_blocks)
        torch.cuda._sleep(5_000_000)  # the previous replay still runs while this fill waits for it
        staged = stage_decode(st, bs, slots, drafts, counts, upload=False)
        st.replay_uploading(graph, staged)
        torch.cuda.synchronize()
        md = launch_decode_inplace(st, cfg, out=out)  # views of the buffers the replay wrote
        torch.cuda.synchronize()
        diff = metadata_diff(metadata_prefix(md, staged.num_seqs, staged.total_q), want, cfg=cfg)
        assert not diff, (step, diff)
        acc = np.array([rng.randint(1, int(c) + 1) for c in counts])
        bs.append_tokens_batch(slots, np.array([rng.randrange(100) for _ in range(int(acc.sum()))]), acc)


def test_upload_follows_stream_switches() -> None:
    """``DecodeStaging`` keeps ONE ``Stream`` object while the current stream stays the same
    (``torch.cuda.current_stream`` builds one per call) and follows every ``torch.cuda.stream``
    switch: each upload runs on the stream current at the call (recorded as its stream), and the
    device buffer holds the last batch staged, whichever stream staged the one before."""
    st = DecodeStaging("cuda", 4096)
    side = torch.cuda.Stream()
    rng = random.Random(6)
    main = torch.cuda.current_stream()
    for i, s in enumerate((main, side, side, main, side, main, main)):
        with torch.cuda.stream(s):
            seqs = [_cap_seq(rng.randint(1, 2), rng.randint(2, 300), j) for j in range(rng.randint(1, CAP_SEQS))]
            torch.cuda._sleep(5_000_000)  # the previous upload may still be queued on the other stream
            staged = st.stage(seqs, CFG)
            assert st._current_stream() is st._current_stream(), i
            assert st._current_stream() == torch.cuda.current_stream() == s, i
            assert st._up_stream == s, i
        torch.cuda.synchronize()
        assert torch.equal(st.device_buffer[:staged.used].cpu(), st.host_buffer[:staged.used]), i
