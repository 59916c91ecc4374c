"""``--attention-check``: CP attention from the broadcast alone equals single-rank attention.

A toy attention client, one head of width ``HEAD_DIM``. Query, key and value of position ``p``
of the sequence with id ``sid`` (:func:`seq_ids`: its ``state_id``, or its index in the step on a
plain config, which has no state slot) are a fixed function :func:`qkv` of ``(sid, p)`` -- what a
KV cache would hold for it (the cache is rebuilt every step). It reads the common fields only
(positions, ``cu_seqlens_q/k``, ``valid_token_mask``, ``context_lens``, ``block_tables``, the
mirror's indices), so it runs on every config (docs/design.md section 14). Per step, every rank:

prefill (prompt metadata, zigzag mirror of docs/design.md section 8)
    computes q/k/v of ITS mirror rows (``positions`` of the mirrored metadata), all-gathers the
    new k/v and un-mirrors them (``mirror_cp_reverse_index``) into the chunk's keys; keys before
    the chunk (``p < q_start``, chunked prefill) come from "the cache" (:func:`qkv`); causal
    attention of its rows; outputs all-gathered and un-mirrored -> ``[total_q, D]``.
decode (CP-interleaved KV, docs/design.md section 11)
    writes the KV of the positions it owns into ITS OWN paged cache through its own slot mapping
    (``compute_slot_mapping`` with the CP arguments and the broadcast ``block_tables``), reads
    back local offsets ``0 .. cp_local_seqlens(pos + 1) - 1`` through the same block table, and
    returns partial output + log-sum-exp; the ranks combine by LSE.

Rank 0 compares with single-rank attention over the full rows (every key from :func:`qkv`) and
broadcasts the verdict, so all ranks stop together. Tolerances (:data:`TOLERANCE`): CPU float64
prefill is bit-exact (same per-row arithmetic on both sides); CPU float64 decode within 1e-12
(the LSE combination reorders the sums); CUDA bf16 (prefill: ``scaled_dot_product_attention``
on both sides; decode: bf16 cache, float32 math, vs the float64 reference) within 2e-2 absolute.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

import cpmeta
import cpmeta.constants
from cpmeta.metadata import InputMetadata

from . import comm

__all__ = ["HEAD_DIM", "TOLERANCE", "qkv", "seq_ids", "prefill_check", "decode_check", "check_step"]

HEAD_DIM: int = 16
_ROW_CHUNK: int = 32  # float64 rows per elementwise pass (bounds memory: 32 x seqlen_k x HEAD_DIM)
#: (prefill, decode) absolute tolerance per device type; 0.0 = bit-exact.
TOLERANCE: dict[str, tuple[float, float]] = {"cpu": (0.0, 1e-12), "cuda": (2e-2, 2e-2)}


def qkv(sid: torch.Tensor, pos: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, HEAD_DIM]: ``which`` 0/1/2 = q/k/v of (sequence id, position), values in [-1, 1].

    ``sin(0.013 * (d + 1) * p + 1.37 * sid + 0.71 * which * (d + 1))`` in float64, then cast.
    """
    d = torch.arange(1, HEAD_DIM + 1, dtype=torch.float64, device=pos.device)
    x = 0.013 * pos.to(torch.float64)[:, None] * d + 1.37 * sid.to(torch.float64)[:, None] + 0.71 * which * d
    return torch.sin(x).to(dtype)


def seq_ids(md: InputMetadata, device: torch.device) -> torch.Tensor:
    """[num_seqs] int64: the id :func:`qkv` uses for each sequence of the step -- its state slot
    (``state_block_idx`` rows: prompt [n_seq], decode one per row, read at each sequence's first
    row) when the config has a sliding-window state cache, else its index ``0..n_seq-1``. Either is
    the same on every rank (both come from the broadcast). Example: plain config, 3 sequences ->
    ``[0, 1, 2]``."""
    assert md.cu_seqlens_q is not None  # every step's metadata carries it (docs/design.md section 4)
    n = md.cu_seqlens_q.shape[0] - 1
    if md.state_block_idx is None:
        return torch.arange(n, device=device)
    idx = md.state_block_idx.to(device, torch.int64)
    return idx if md.is_prompt else idx[md.cu_seqlens_q[:-1].to(device, torch.int64)]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Causal attention of rows at ``qpos`` over keys at positions ``0 .. len(k) - 1``."""
    mask = torch.arange(k.shape[0], device=k.device)[None, :] <= qpos[:, None].to(torch.int64)
    if q.dtype == torch.float64:  # row by row arithmetic (no GEMM: its blocking depends on the row count)
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], _ROW_CHUNK):
            s = (q[a:a + _ROW_CHUNK, None, :] * k[None]).sum(-1) / math.sqrt(HEAD_DIM)
            p = torch.softmax(s.masked_fill(~mask[a:a + _ROW_CHUNK], float("-inf")), dim=-1)
            out[a:a + _ROW_CHUNK] = (p[:, :, None] * v[None]).sum(1)
        return out
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None])[0]


def _gather_rows(part: torch.Tensor, reverse: torch.Tensor, world: int) -> torch.Tensor:
    parts = comm.all_gather(part)
    return cpmeta.unmirror(torch.cat(parts), reverse.to(part.device))


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float64 if device.type == "cpu" else torch.bfloat16


def prefill_check(full: InputMetadata, mine: InputMetadata, world: int, device: torch.device) -> float:
    """Collective. Returns rank 0's max |CP - single-rank| over all rows (0.0 elsewhere)."""
    # every prompt step's metadata and its mirror carry these (docs/design.md sections 4 and 8)
    assert full.cu_seqlens_q is not None and full.cu_seqlens_k is not None
    assert mine.mirror_cp_index is not None and mine.mirror_cp_reverse_index is not None
    assert mine.positions is not None
    dt = _dtype(device)
    cu_q = full.cu_seqlens_q.to(device, torch.int64)
    cu_k = full.cu_seqlens_k.to(device, torch.int64)
    sid_seq = seq_ids(full, device)
    idx = mine.mirror_cp_index.to(device, torch.int64)
    seq = torch.searchsorted(cu_q[1:], idx.clamp(min=0), right=True)  # sequence of each mirror row
    pos, sid = mine.positions.to(device), sid_seq[seq]
    real = idx >= 0
    new_k = qkv(sid, pos, 1, dt) * real[:, None]
    new_v = qkv(sid, pos, 2, dt) * real[:, None]
    reverse = mine.mirror_cp_reverse_index
    chunk_k, chunk_v = _gather_rows(new_k, reverse, world), _gather_rows(new_v, reverse, world)
    q = qkv(sid, pos, 0, dt)
    out = torch.zeros_like(q)
    for s in range(cu_q.shape[0] - 1):
        a, b, seqlen_k = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s + 1] - cu_k[s])
        q_start = seqlen_k - (b - a)
        hist = torch.arange(q_start, device=device)
        k = torch.cat([qkv(sid_seq[s].expand(q_start), hist, 1, dt), chunk_k[a:b]])  # cache + chunk
        v = torch.cat([qkv(sid_seq[s].expand(q_start), hist, 2, dt), chunk_v[a:b]])
        rows = ((seq == s) & real).nonzero()[:, 0]
        if rows.numel():
            out[rows] = _attend(q[rows], k, v, pos[rows])
    result = _gather_rows(out, reverse, world)
    if dist.get_rank() != 0:
        return 0.0
    return _max_err(result, _single_rank(full, device, dt))


def _single_rank(full: InputMetadata, device: torch.device, dt: torch.dtype) -> torch.Tensor:
    """[total_q, D]: every row attends over keys 0..pos, all computed directly from qkv."""
    assert full.cu_seqlens_q is not None and full.cu_seqlens_k is not None  # a prompt step's fields
    assert full.positions is not None
    cu_q, cu_k = full.cu_seqlens_q.tolist(), full.cu_seqlens_k.tolist()
    pos_all = full.positions.to(device)
    sids = seq_ids(full, device)
    out = torch.empty(pos_all.shape[0], HEAD_DIM, dtype=dt, device=device)
    for s in range(len(cu_q) - 1):
        sid, n_k = sids[s], cu_k[s + 1] - cu_k[s]
        kpos = torch.arange(n_k, device=device)
        k, v = qkv(sid.expand(n_k), kpos, 1, dt), qkv(sid.expand(n_k), kpos, 2, dt)
        p = pos_all[cu_q[s]:cu_q[s + 1]]
        out[cu_q[s]:cu_q[s + 1]] = _attend(qkv(sid.expand(p.shape[0]), p, 0, dt), k, v, p)
    return out


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0


def decode_check(md: InputMetadata, rank: int, world: int, device: torch.device, block_size: int,
                 interleave: int) -> float:
    """Collective. Partial attention over this rank's KV shard, combined by LSE on every rank.

    Returns this rank's error: rank 0 the max |combined - single-rank| over real rows; any rank
    ``inf`` when its own slot mapping wrote two positions to one slot.
    """
    # every decode step's metadata carries these (docs/design.md section 4)
    assert md.cu_seqlens_q is not None and md.cu_seqlens_k is not None and md.valid_token_mask is not None
    assert md.block_tables is not None and md.positions is not None and md.context_lens is not None
    cache_dt, dt = _dtype(device), (torch.float64 if device.type == "cpu" else torch.float32)
    cu_q, cu_k = md.cu_seqlens_q.to(device, torch.int64), md.cu_seqlens_k.to(device, torch.int64)
    first = cu_q[:-1]
    real = md.valid_token_mask.to(device)[first]  # placeholders write no KV
    sid, table = seq_ids(md, device), md.block_tables.to(device)[first]
    # ---- write: positions 0..seqlen_k-1 of every real sequence, only the owned ones land here
    klen = torch.where(real, cu_k[1:] - cu_k[:-1], 0)
    qsl = torch.cat([klen.new_zeros(1), klen.cumsum(0)])
    kseq = torch.repeat_interleave(torch.arange(klen.shape[0], device=device), klen)
    kpos = torch.arange(kseq.shape[0], device=device) - qsl[kseq]
    slots = cpmeta.compute_slot_mapping(qsl, kpos, table, block_size, max_num_tokens=kseq.shape[0],
                                        cp_world_size=world, cp_rank=rank, cp_interleave=interleave)
    own = slots != cpmeta.constants.PAD_SLOT_ID
    where = slots[own].to(torch.int64)
    if where.numel() and (int(where.min()) < 0 or where.unique().numel() != where.numel()):
        return float("inf")
    n_slots = int(where.max()) + 1 if where.numel() else 0
    cache = torch.full((2, n_slots + 1, HEAD_DIM), float("nan"), dtype=cache_dt, device=device)  # +1: NaN row
    for which in (1, 2):
        cache[which - 1, where] = qkv(sid[kseq[own]], kpos[own], which, cache_dt)
    # ---- read: local offsets 0..n-1 of the row's shard, n = cp_local_seqlens(pos + 1)
    pos = md.positions.to(device, torch.int64)
    rseq = torch.searchsorted(cu_q[1:], torch.arange(pos.shape[0], device=device), right=True)
    n_loc = cpmeta.cp_local_seqlens(md.context_lens.to(device), world, rank, interleave).to(torch.int64)
    n_loc = n_loc * real[rseq]
    width = int(n_loc.max()) if n_loc.numel() else 0
    local = torch.arange(width, device=device)  # kvb = block_size: local offset -> (block, offset)
    valid = local[None, :] < n_loc[:, None]
    bi = (local // block_size).clamp(max=table.shape[1] - 1)
    slot = table[rseq][:, bi].to(torch.int64) * block_size + local % block_size
    slot = torch.where(valid & (slot >= 0) & (slot < n_slots), slot, n_slots)
    k = torch.where(valid[..., None], cache[0, slot].to(dt), 0)
    v = torch.where(valid[..., None], cache[1, slot].to(dt), 0)
    q = qkv(sid[rseq], pos, 0, dt)
    scores = torch.einsum("rd,rnd->rn", q, k).div(math.sqrt(HEAD_DIM)).masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where this rank owns none of the row's keys
    part = torch.einsum("rn,rnd->rd", torch.exp(scores - lse[:, None]).nan_to_num(0.0), v)
    # ---- combine by log-sum-exp over ranks
    parts, lses = comm.all_gather(part), comm.all_gather(lse)
    lse_all = torch.stack(lses)
    weight = torch.exp(lse_all - torch.logsumexp(lse_all, dim=0)).nan_to_num(0.0)
    result = (weight[..., None] * torch.stack(parts)).sum(0)
    if dist.get_rank() != 0:
        return 0.0
    rows = real[rseq]
    return _max_err(result[rows], _single_rank_decode(sid[rseq], pos, device)[rows])


def _single_rank_decode(sid: torch.Tensor, pos: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[rows, D] float64: row at ``pos`` attends over keys 0..pos computed directly from qkv."""
    width = int(pos.max()) + 1 if pos.numel() else 0
    kpos = torch.arange(width, device=device)
    ksid = sid[:, None].expand(-1, width).reshape(-1)
    k = qkv(ksid, kpos.repeat(sid.shape[0]), 1, torch.float64).reshape(sid.shape[0], width, HEAD_DIM)
    v = qkv(ksid, kpos.repeat(sid.shape[0]), 2, torch.float64).reshape(sid.shape[0], width, HEAD_DIM)
    q = qkv(sid, pos, 0, torch.float64)
    s = torch.einsum("rd,rnd->rn", q, k).div(math.sqrt(HEAD_DIM))
    s = s.masked_fill(kpos[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("rn,rnd->rd", torch.softmax(s, dim=-1), v)


def check_step(got: InputMetadata, mine: Optional[InputMetadata], rank: int, world: int,
               device: torch.device, block_size: int, interleave: int, step: int) -> float:
    """Collective, every rank every step. Raises the same ``VerifyError`` on every rank on failure.

    Example, W=2, prompt step: both ranks call it with the broadcast ``got`` and their mirror
    (computed here when ``mine`` is None); both return the max error or both raise.
    """
    from .verify import VerifyError

    if got.is_prompt:
        mine = mine if mine is not None else cpmeta.prepare_for_mirror_cp(got, rank, world)
        err, kind, tol = prefill_check(got, mine, world, device), "prefill", TOLERANCE[device.type][0]
    else:
        err, kind, tol = decode_check(got, rank, world, device, block_size, interleave), "decode", \
            TOLERANCE[device.type][1]
    verdict = torch.tensor([err if err == err else float("inf")], dtype=torch.float64, device=device)
    worst = float(comm.all_reduce(verdict, op=dist.ReduceOp.MAX))
    if not worst <= tol:
        raise VerifyError(f"step {step}: {kind} attention under CP {world} differs from single-rank "
                          f"attention: max |diff| = {worst:.3g} > {tol:g} (inf = a slot written twice)")
    return worst
