"""In-place decode capacity (docs/design.md section 12, issue 16 item 3): too-large batches are refused
before the device sees them, and the kernels never write outside their buffers.

Buffers captured for ``Q_CAP = 8`` rows, ``SEQ_CAP = 4`` sequences and ``cfg.max_num_blocks``
block-table columns; each refused batch is ONE unit too large:

- ``rows``:    4 sequences, 9 rows           -> "total_q: 9 rows exceed the captured buffers' q_cap=8"
- ``seqs``:    5 one-row sequences           -> "num_seqs: 5 sequences exceed ... seq_cap=4"
- ``columns``: a config with a larger ``max_model_len``, one sequence needing ``bt_cols + 1``
  block-table columns                        -> "block_tables: ... bt_cols=..."

Checked on the eager path (``prepare_decode_inplace(out=...)``: nothing written), the staged path
(``stage()`` refuses before the copy; ``launch_decode_inplace`` refuses a batch staged before the
buffers were known), and the kernels called directly on an oversize staged batch with guard
regions around every buffer (torch emulation here; the Triton kernels under
``TRITON_INTERPRET=1`` in a subprocess, bit-identical to the emulation, guards intact). The
CUDA graph capture + replay version is in ``tests/test_cuda_graph.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from cpmeta.builders.decode import prepare_decode
from cpmeta.config import MetadataConfig
from cpmeta.diff import metadata_diff
from cpmeta.gpu.decode_inplace import DecodeStaging, launch_decode_inplace, prepare_decode_inplace
from cpmeta.gpu.decode_buffers import DecodeBuffers
from cpmeta.sequence import SequenceMetadata, blocks_needed
from strategies import metadata_prefix

HAS_TRITON = importlib.util.find_spec("triton") is not None
Q_CAP, SEQ_CAP = 8, 4
GUARD = 5  # extra rows / columns around each buffer in the direct kernel test
SENTINEL = -12345
CFG = MetadataConfig(block_size=16, window_size=8, swa_block_size=9, dense_compress_ratios=(4, 16),
                     sparse_compress_ratios=(4,), max_model_len=256, max_ngram_size=2)
#: Same kernels' config but twice the model length: more block-table columns.
CFG_LONG = MetadataConfig(block_size=16, window_size=8, swa_block_size=9, dense_compress_ratios=(4, 16),
                          sparse_compress_ratios=(4,), max_model_len=512, max_ngram_size=2)


def _seq(q: int, k: int, state: int, cfg: MetadataConfig = CFG) -> SequenceMetadata:
    toks = [(3 * i + 1) % 50 for i in range(k)]
    return SequenceMetadata(seqlen_q=q, seqlen_k=k, block_table=list(range(blocks_needed(k, cfg))),
                            state_id=state, token_ids=toks[: k - q + 1], draft_tokens=toks[k - q + 1:])


def _capture_batch() -> list[SequenceMetadata]:
    return [_seq(2, 20 + 7 * i, i) for i in range(SEQ_CAP)]  # 4 sequences, 8 rows


TOO_LARGE: dict[str, tuple[MetadataConfig, Callable[[], list[SequenceMetadata]], str]] = {
    "rows": (CFG, lambda: [_seq(2, 30, 0), _seq(2, 31, 1), _seq(2, 32, 2), _seq(3, 33, 3)],
             r"total_q: 9 rows exceed the captured buffers' q_cap=8"),
    "seqs": (CFG, lambda: [_seq(1, 10 + i, i) for i in range(SEQ_CAP + 1)],
             r"num_seqs: 5 sequences exceed the captured buffers' seq_cap=4"),
    "columns": (CFG_LONG, lambda: [_seq(1, CFG.max_model_len + CFG.block_size, 0, CFG_LONG)],
                rf"block_tables: {CFG.max_num_blocks + 1} columns exceed the captured buffers' "
                rf"bt_cols={CFG.max_num_blocks}"),
}


def _captured(backend: str) -> tuple[DecodeStaging, dict[str, torch.Tensor]]:
    st, out = DecodeStaging("cpu"), {}
    prepare_decode_inplace(_capture_batch(), CFG, out=out, device="cpu", backend=backend, staging=st)
    assert out["positions"].shape[0] == Q_CAP and out["cu_seqlens_q"].shape[0] == SEQ_CAP + 1
    return st, out


def _snapshot(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.parametrize("case", sorted(TOO_LARGE))
def test_eager_refuses_before_writing(case: str) -> None:
    cfg, make, msg = TOO_LARGE[case]
    st, out = _captured("torch")
    before = _snapshot(out)
    with pytest.raises(ValueError, match=msg):
        prepare_decode_inplace(make(), CFG, out=out, device="cpu", staging=st) if cfg is CFG else \
            st.stage(make(), cfg)
    assert all(torch.equal(before[k], out[k]) for k in out), "a refused batch reached the buffers"


@pytest.mark.parametrize("case", sorted(TOO_LARGE))
def test_staged_path_refuses_then_recovers(case: str) -> None:
    """stage() knows the captured buffers' limits; the previous batch stays usable."""
    cfg, make, msg = TOO_LARGE[case]
    st, out = _captured("torch")
    ok = [_seq(1, 40, 0), _seq(3, 41, 1)]
    staged = st.stage(ok, CFG)
    with pytest.raises(ValueError, match=msg):
        st.stage(make(), cfg)
    assert st.last_staged == staged
    staged = st.stage(ok, CFG)  # refill: the refused batch left nothing behind
    md = launch_decode_inplace(st, CFG, out=out, backend="torch")
    assert not metadata_diff(metadata_prefix(md, staged.num_seqs, staged.total_q), prepare_decode(ok, CFG, table_width=CFG.max_num_blocks), cfg=CFG)


@pytest.mark.parametrize("case", ["rows", "seqs"])
def test_launch_refuses_batch_staged_before_buffers_known(case: str) -> None:
    _, make, msg = TOO_LARGE[case]
    _, out = _captured("torch")
    st = DecodeStaging("cpu")  # a second staging: has not seen `out` yet
    st.stage(make(), CFG)
    before = _snapshot(out)
    with pytest.raises(ValueError, match=msg):
        launch_decode_inplace(st, CFG, out=out, backend="torch")
    assert all(torch.equal(before[k], out[k]) for k in out)


# ---- kernels called wrongly: masked to their buffers ------------------------------------------


def _guarded(cfg: MetadataConfig, q_cap: int, seq_cap: int, bt_cols: int) -> tuple[DecodeBuffers, dict]:
    """DecodeBuffers whose tensors are views of larger ones (GUARD extra rows / columns, SENTINEL)."""
    i32, g = torch.int32, cfg.max_ngram_size

    def rows(*rest: int, dtype: torch.dtype = i32) -> tuple[torch.Tensor, torch.Tensor]:
        big = torch.full((q_cap + GUARD, *rest), SENTINEL, dtype=i32).to(dtype) if dtype == i32 else \
            torch.full((q_cap + GUARD, *rest), 7, dtype=torch.uint8).view(torch.bool)
        return big, big[:q_cap]

    def stacked(n: int, *rest: int) -> tuple[torch.Tensor, torch.Tensor]:
        big = torch.full((n, q_cap + GUARD, *rest), SENTINEL, dtype=i32)
        return big, big[:, :q_cap]

    bt_big = torch.full((q_cap + GUARD, bt_cols + GUARD), SENTINEL, dtype=i32)
    cu = {k: torch.full((seq_cap + 1 + GUARD,), SENTINEL, dtype=i32) for k in ("q", "k")}
    n_ca, n_sp, n_dn = len(cfg.ca_ratios), len(cfg.sparse_compress_ratios), len(cfg.dense_compress_ratios)
    parts = {
        "positions": rows(), "input_ids": rows(), "gate_force_random": rows(dtype=torch.bool),
        "ngram_token_ids": rows(g) if g else (None, None),
        "valid_token_mask": rows(dtype=torch.bool), "query_indices": rows(),
        "slot_mapping_store_swa": rows(), "state_block_idx": rows(), "context_lens": rows(),
        "kv_swa_index_offset_len": rows(2), "block_tables": (bt_big, bt_big[:q_cap, :bt_cols]),
        "cu_seqlens_q": (cu["q"], cu["q"][: seq_cap + 1]), "cu_seqlens_k": (cu["k"], cu["k"][: seq_cap + 1]),
        "positions_c": stacked(n_ca), "slot_mapping_store_ca": stacked(n_ca), "klen": stacked(n_sp),
        "kv_ca_index_offset_len": stacked(n_dn, 2),
    }
    return DecodeBuffers({k: v for k, (_, v) in parts.items() if v is not None}), {k: b for k, (b, _) in parts.items()}


def _guards_intact(big: dict, q_cap: int, seq_cap: int, bt_cols: int) -> list[str]:
    bad = []
    for name, t in big.items():
        if t is None:
            continue
        raw = t.view(torch.uint8) if t.dtype == torch.bool else t
        sent = 7 if t.dtype == torch.bool else SENTINEL
        if name == "block_tables":
            regions = [raw[q_cap:], raw[:, bt_cols:]]
        elif name.startswith("cu_seqlens"):
            regions = [raw[seq_cap + 1:]]
        elif name in ("positions_c", "slot_mapping_store_ca", "klen", "kv_ca_index_offset_len"):
            regions = [raw[:, q_cap:]]
        else:
            regions = [raw[q_cap:]]
        bad += [name for r in regions if not (r == sent).all()]
    return bad


def run_kernels_masked(launch: Callable[[torch.Tensor, MetadataConfig, DecodeBuffers], None]) -> dict:
    """Every too-large case launched straight at guarded buffers of the captured size; returns the
    full guarded tensors per case (for the bit-identity check between kernel and emulation)."""
    results = {}
    for case, (cfg, make, _) in sorted(TOO_LARGE.items()):
        seqs = make()
        st = DecodeStaging("cpu")  # no limits known: stage() accepts it
        staged = st.stage(seqs, cfg)
        bt_cols = CFG.max_num_blocks
        bufs, big = _guarded(cfg, Q_CAP, SEQ_CAP, bt_cols)
        launch(st.device_buffer, cfg, bufs)
        bad = _guards_intact(big, Q_CAP, SEQ_CAP, bt_cols)
        assert not bad, f"{case}: wrote outside the buffers: {bad}"
        ref = prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks)
        rows = min(Q_CAP, staged.total_q) if staged.num_seqs <= SEQ_CAP else \
            int(ref.cu_seqlens_q[SEQ_CAP])
        assert torch.equal(bufs["positions"][:rows], ref.positions[:rows]), case
        assert torch.equal(bufs["slot_mapping_store_swa"][:rows], ref.slot_mapping_store_swa[:rows]), case
        results[case] = big
    return results


def test_emulation_never_writes_outside_buffers() -> None:
    from cpmeta.gpu.decode_emulate import emulate_decode_kernels

    run_kernels_masked(emulate_decode_kernels)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_masked_in_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--interpret"], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "capacity interpreter cases passed" in proc.stdout


def _interpreter_main() -> None:
    from cpmeta.gpu.decode_emulate import emulate_decode_kernels
    from cpmeta.gpu.decode_triton import launch_decode_kernels

    got = run_kernels_masked(launch_decode_kernels)
    want = run_kernels_masked(emulate_decode_kernels)
    for case in got:
        for name, t in got[case].items():
            assert t is None or torch.equal(t, want[case][name]), (case, name)
    # the refusals through the triton backend too
    for case, (cfg, make, msg) in TOO_LARGE.items():
        st, out = _captured("triton")
        try:
            if cfg is CFG:
                prepare_decode_inplace(make(), CFG, out=out, device="cpu", backend="triton", staging=st)
            else:
                st.stage(make(), cfg)
        except ValueError as e:
            assert msg.split(":")[0] in str(e), (case, e)
        else:
            raise AssertionError(f"{case}: not refused")
    print(f"{len(got)} capacity interpreter cases passed")


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        _interpreter_main()
