#!/usr/bin/env python
"""Context-parallel greedy generation with a real HuggingFace Llama, from cpmeta's broadcast alone.

    python scripts/cp_generate.py --cp 2
    python scripts/cp_generate.py --cp 3 --interleave 16 --dtype float64      # KV interleave = block size
    python scripts/cp_generate.py --cp 2 --config seed                        # the seed's compressed config
    python scripts/cp_generate.py --cp 1 --device cuda --dtype bfloat16       # NCCL world 1
    python scripts/cp_generate.py --cp 2 --device cuda --dtype float32        # gloo ranks sharing cuda:0

``--cp N`` ranks (spawned processes, torch.distributed: gloo, NCCL for ``--device cuda --cp 1``)
each build the same tiny ``transformers`` Llama (``TINY_LLAMA`` below: 2 layers, hidden 64,
4 heads, 2 KV heads, vocab 128, random weights from ``--seed``; nothing is downloaded). Rank 0
is the driver: its tiny scheduler keeps the requests in a ``cpmeta.BatchState``, builds each
step's metadata (``prepare_prompt`` / ``prepare_decode``) and broadcasts it with
``cpmeta.MetadataBroadcaster``. Followers never see a scheduler object: token ids come from
``md.input_ids``, block tables from the metadata, sampled tokens from the next step's metadata.
Every step has a placeholder sequence (no KV written, no keys read).

KV layout: every rank owns a paged cache ``[layers, blocks, block_size, KVH, D]``; with the
plain config the keys are interleaved over the group (``kv_cp_world_size = cp``, position p on
rank ``(p // I) % cp``), with the seed config every rank holds all keys (``kv_cp_world_size = 1``:
the compressed config refuses sharding). Per step and layer:

prefill (zigzag, chunked prompt: ``--chunk`` tokens per request per step)
    rows: ``mine = prepare_for_mirror_cp(md, r, p)``, ids ``mirror_rows(md.input_ids,
    mine.mirror_cp_index, 0)``, positions ``mine.positions``. Write: the slots from
    ``compute_slot_mapping_from_metadata(md, ...)`` are FULL-ORDER rows, while a rank computed
    K/V only for its mirror rows, and the owner of a key (by position) is usually another rank
    than the one that computed it; so K/V of the rows are all-gathered and restored with
    ``unmirror(parts, mine.mirror_cp_reverse_index)``, and every rank writes the rows whose slot
    is not -1 (its share). Read: ``cp_kv_read_plan(md, cfg, cp_rank=r)`` lists the keys this
    rank holds of every sequence, history (earlier chunks) and this chunk; their K/V (and, once
    per step, their (sequence, position) labels) are padded to ``plan.max_total`` and
    all-gathered, and each rank attends its own rows over every key of their sequence at a
    position <= the row's. Outputs (logits) are all-gathered and un-mirrored.
decode (one row per request; interleaved KV)
    every rank computes q/k/v of all rows, the owner writes the new key (slot != -1), each rank
    attends over its local shard (``plan.slots``: ``cp_local_seqlens(pos + 1)`` keys per row)
    and returns output + log-sum-exp; the ranks combine by LSE (``combine_lse``).

Rank 0 then runs the UNMODIFIED model in one process: ``generate(do_sample=False)`` per request,
and one forward over prompt + generated tokens (teacher forcing) for the logits. It prints the
tokens, whether they equal ``generate``'s, and the max |logit diff| over every row; exit code 1
on a mismatch (float64: logits within 1e-9 and tokens equal to ``generate``; float32/bfloat16:
logits within the dtype's tolerance and every greedy token equal to the reference's argmax on
the same inputs, since a near-tie may flip between two correct low-precision runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpmeta  # noqa: E402
import cpmeta.cp
from cpmeta import InputMetadata, MetadataConfig  # noqa: E402

from cpmeta.launch import envs as launch_envs  # noqa: E402
from cpmeta.launch.comm import all_gather, broadcast  # noqa: E402
from _harness.bench_meta import write_result  # noqa: E402  (scripts/_harness/bench_meta.py: the shared harness)

# ---- the model side ----------------------------------------------------------------------------
# A HuggingFace Llama driven row by row, paged KV.
#
# Nothing here knows about the scheduler or the broadcast: it takes rows (token ids, positions),
# a per-rank paged KV cache and an ``attend`` callback, and runs the unmodified HF modules of
# ``transformers``' ``LlamaForCausalLM`` around it -- ``embed_tokens``, per decoder layer the
# ``input_layernorm``, ``q_proj`` / ``k_proj`` / ``v_proj``, rotary embedding at the rows'
# positions (``rotary_emb`` + ``apply_rotary_pos_emb``), ``o_proj``, ``post_attention_layernorm``,
# ``mlp``; then ``norm`` and ``lm_head``. Only the attention computation is replaced:
# :func:`partial_attention` (softmax over the keys a row may see, with its log-sum-exp) and
# :func:`combine_lse` (merge of several ranks' partial results).
#
# Shapes: ``R`` rows, ``H`` query heads, ``KVH`` KV heads, ``D`` head dim, ``N`` keys.

#: The tiny Llama of the example: built in memory from a fixed seed, nothing is downloaded.
#: ``initializer_range`` 0.2 (HF default 0.02) so greedy choices are decisive (top-2 logit margins
#: well above float noise); no BOS/EOS so ``generate`` makes exactly ``max_new_tokens`` tokens.
TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    pad_token_id=0,
)
NO_GROUP = -1  #: group id of a pad row / pad key: a key with a negative group is never seen


def build_model(dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """``LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))`` with weights drawn from ``seed`` (on the
    CPU, so every rank and the reference get the same weights), cast to ``dtype``, on ``device``,
    in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    return model.to(dtype=dtype, device=device).eval()


@dataclasses.dataclass
class PagedKVCache:
    """One rank's paged KV cache: ``k``, ``v`` [layers, num_blocks, block_size, KVH, D].

    A slot ``s`` is row ``s`` of the flattened ``[num_blocks * block_size]`` view: block
    ``s // block_size``, offset ``s % block_size`` (slot 37 with block size 16 = block 2, row 5).
    Every rank allocates the same number of blocks; the block ids of a sequence's table are the
    same on every rank, each rank's blocks hold its own share of the keys (DESIGN 11).
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, model: Any, num_blocks: int, block_size: int) -> "PagedKVCache":
        c = model.config
        head_dim = c.hidden_size // c.num_attention_heads
        p = next(model.parameters())
        shape = (c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, head_dim)
        nan = float("nan")  # a read of a slot nobody wrote shows up in the logits
        return cls(torch.full(shape, nan, dtype=p.dtype, device=p.device),
                   torch.full(shape, nan, dtype=p.dtype, device=p.device))

    def _flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kvh, d = self.k.shape[-2:]
        return self.k[layer].view(-1, kvh, d), self.v[layer].view(-1, kvh, d)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows ``k``/``v`` [R, KVH, D] at ``slots`` [R] (int); rows with slot -1 are skipped."""
        own = slots >= 0
        where = slots[own].to(device=self.k.device, dtype=torch.int64)
        fk, fv = self._flat(layer)
        fk[where] = k[own]
        fv[where] = v[own]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [N, KVH, D] at ``slots`` [N] (every slot >= 0)."""
        fk, fv = self._flat(layer)
        idx = slots.to(device=self.k.device, dtype=torch.int64)
        return fk[idx], fv[idx]


def partial_attention(q: torch.Tensor, q_group: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, k_group: torch.Tensor, k_pos: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of query rows over a SET of keys, each labelled (group, position).

    ``q`` [R, H, D]; ``k``, ``v`` [N, KVH, D] (query head h reads KV head ``h // (H // KVH)``,
    as HF's ``repeat_kv``); ``q_group`` / ``q_pos`` [R], ``k_group`` / ``k_pos`` [N] int64.
    Row i sees key n iff ``k_group[n] == q_group[i] >= 0`` and ``k_pos[n] <= q_pos[i]``; the keys may
    come in any order (a sum over a set). Returns ``(out [R, H, D], lse [R, H] float32/64)``:
    ``out`` is normalized over the keys seen here, ``lse`` their log-sum-exp of scores (``-inf``
    and ``out = 0`` for a row that sees none, e.g. a placeholder, or a rank holding none of its
    keys). Math in float64 for float64 input, else float32.
    Example: one row (group 0, pos 5), keys (0, 3), (0, 7), (1, 2): only the first is seen.
    """
    math_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    kk = k.to(math_dt).repeat_interleave(rep, dim=1)
    vv = v.to(math_dt).repeat_interleave(rep, dim=1)
    scores = torch.einsum("rhd,nhd->hrn", q.to(math_dt), kk) / math.sqrt(q.shape[-1])
    seen = (q_group[:, None] == k_group[None, :]) & (k_pos[None, :] <= q_pos[:, None]) \
        & (k_group >= 0)[None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, R]
    prob = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # -inf - -inf = nan: no key seen
    out = torch.einsum("hrn,nhd->rhd", prob, vv)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def combine_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Merge partial attention results by log-sum-exp: ``sum_r exp(lse_r - LSE) * out_r`` with
    ``LSE = logsumexp_r lse_r``. ``outs[r]`` [R, H, D], ``lses[r]`` [R, H]; a rank with ``lse =
    -inf`` (none of the row's keys) weighs 0; a row no rank saw stays 0.
    Example: two ranks, lse = log 1 and log 3, outs a and b -> (a + 3 b) / 4."""
    lse = torch.stack(lses)  # [P, R, H]
    weight = torch.exp(lse - torch.logsumexp(lse, dim=0)).nan_to_num(0.0)
    out = (weight[..., None] * torch.stack(outs).to(weight.dtype)).sum(0)
    return out.to(outs[0].dtype)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def forward_rows(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend
                 ) -> torch.Tensor:
    """Logits [R, vocab] of rows ``input_ids`` [R] at ``positions`` [R] (int, any order).

    Runs the HF modules on the rows; per layer ``attend(layer, q [R, H, D], k [R, KVH, D],
    v [R, KVH, D])`` (q and k already rotated) returns the attention output [R, H, D] -- the
    caller writes k/v to its cache and reads what the rows may see. Collective when ``attend``
    is. Pad rows (any id, position 0) compute garbage that the caller drops.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    dev = model.lm_head.weight.device
    h = model.model.embed_tokens(input_ids.to(dev, torch.int64))
    cos, sin = model.model.rotary_emb(h, positions.to(dev, torch.int64)[None])  # [1, R, D]
    rows = h.shape[0]
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        x = layer.input_layernorm(h)
        q = att.q_proj(x).view(rows, -1, att.head_dim)
        k = att.k_proj(x).view(rows, -1, att.head_dim)
        v = att.v_proj(x).view(rows, -1, att.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)  # [R, heads, D]
        h = h + att.o_proj(attend(i, q, k, v).reshape(rows, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


# ---- the example -------------------------------------------------------------------------------

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
#: max |logit diff| allowed vs the single-process model, per dtype
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 0.25}


@dataclasses.dataclass(frozen=True)
class GenOptions:
    """One run of the example (every rank gets the same copy)."""

    cp: int = 2
    interleave: int = 1  # kv_cp_interleave I (plain config)
    dtype: str = "float64"
    device: str = "cpu"
    config: str = "plain"  # "plain" or "seed"
    prompt_lens: tuple[int, ...] = (46, 62, 38)  # 46 and 62: tables grow during decode at every CP size
    chunk: int = 32  # prompt tokens per request per prefill step
    new_tokens: int = 4
    seed: int = 0
    block_size: int = 16
    max_model_len: int = 256
    num_blocks: int = 64  # per rank cache size (same on every rank: the engine's memory budget)
    strategy: str = "broadcast"  # or "replicate": every rank builds from its replicated BatchState


def make_config(o: GenOptions) -> MetadataConfig:
    """``plain``: no compressed KV, no sliding window, KV interleaved over the CP group.
    ``seed``: the seed's compressed fields (dense (4,), sparse (4,), window 16), unused by the
    Llama attention; KV replicated (``kv_cp_world_size = 1``)."""
    if o.config == "plain":
        return MetadataConfig(block_size=o.block_size, max_model_len=o.max_model_len,
                              dense_compress_ratios=(), sparse_compress_ratios=(), window_size=0,
                              kv_cp_world_size=o.cp, kv_cp_interleave=o.interleave)
    if o.config == "seed":
        return MetadataConfig(block_size=o.block_size, max_model_len=o.max_model_len,
                              dense_compress_ratios=(4,), sparse_compress_ratios=(4,),
                              window_size=16, swa_block_size=16)
    raise ValueError(f"config: expected 'plain' or 'seed', got {o.config!r}")


def kv_blocks(seqlen_k: int, cfg: MetadataConfig) -> int:
    """Blocks a table needs for ``seqlen_k`` UNCOMPRESSED keys (the Llama's KV), at least what the
    builders validate (``cpmeta.blocks_needed``; for the seed config that counts compressed
    blocks, fewer). Sharded KV: rank 0's share (the largest), e.g. 45 keys, cp 2, I 1 -> 23 keys
    -> 2 blocks of 16."""
    share = cpmeta.cp_local_seqlens(torch.tensor([seqlen_k]), cfg.kv_cp_world_size, 0,
                                    cfg.kv_cp_interleave)
    return max(cpmeta.blocks_needed(seqlen_k, cfg), -(-int(share[0]) // cfg.block_size))


class Driver:
    """Rank 0's tiny scheduler: requests in a ``BatchState``, chunked prefill, then greedy decode.

    ``next_metadata()`` builds the step (``None`` when every request has ``new_tokens`` tokens),
    ``accept(md, logits)`` records the full-order logits rows per request and samples greedily.
    """

    def __init__(self, o: GenOptions, cfg: MetadataConfig, vocab: int, replicated: Any = None) -> None:
        self.o, self.cfg = o, cfg
        gen = torch.Generator().manual_seed(o.seed + 1)
        self.prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in o.prompt_lens]
        self.free = torch.randperm(o.num_blocks, generator=gen).tolist()  # shuffled block ids
        # the calls go to ``ops``: a BatchState, or a ReplicatedBatchState that records them for
        # the followers (--strategy replicate); ``st`` is read
        self.ops: Any = replicated if replicated is not None else cpmeta.BatchState(cfg, max_seqs=len(self.prompts))
        self.st: cpmeta.BatchState = replicated.state if replicated is not None else self.ops
        self.slots = [self.ops.add_request(i, p, block_table=self._alloc(kv_blocks(len(p), cfg)),
                                           state_id=i) for i, p in enumerate(self.prompts)]
        self.generated: list[list[int]] = [[] for _ in self.prompts]
        self.logits: list[dict[int, torch.Tensor]] = [{} for _ in self.prompts]  # position -> row
        self.step_reqs: list[int] = []

    def _alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self.free)} free")
        got, self.free = self.free[:n], self.free[n:]
        return got

    def next_metadata(self) -> Optional[InputMetadata]:
        """The step's metadata built here (``--strategy broadcast``), None when done."""
        batch = self.next_batch()
        if batch is None:
            return None
        return build_metadata(batch, self.cfg)

    def next_batch(self) -> Any:
        """The step's calls on ``ops``: its batch (a ``BatchState``), True (a replicated state:
        ``sync()`` gives the batch on every rank) or None when every request is done."""
        st, o = self.st, self.o
        todo = [i for i, s in enumerate(self.slots) if st.num_computed[s] < len(self.prompts[i])]
        if todo:  # chunked prefill first
            slots = np.array([self.slots[i] for i in todo])
            chunks = np.minimum(st.prompt_len[slots] - st.num_computed[slots], o.chunk)
            self.step_reqs = todo
            got = self.ops.prompt_batch(slots, chunks, num_placeholders=1)
            return True if got is None else got
        todo = [i for i in range(len(self.slots)) if len(self.generated[i]) < o.new_tokens]
        if not todo:
            return None
        for i in todo:  # the table must cover seqlen_k = every confirmed token
            s = self.slots[i]
            need = kv_blocks(int(st.num_tokens[s]), self.cfg) - int(st.num_blocks[s])
            if need > 0:
                self.ops.append_blocks(s, self._alloc(need))
        self.step_reqs = todo
        got = self.ops.decode_batch(np.array([self.slots[i] for i in todo]), num_placeholders=1)
        return True if got is None else got

    def accept(self, md: InputMetadata, logits: torch.Tensor) -> None:
        """``logits`` [total_q, vocab] in full row order; sequence j of the step is request
        ``step_reqs[j]`` (placeholders come after the requests and are ignored)."""
        cu, pos = md.cu_seqlens_q.tolist(), md.positions.tolist()
        logits = logits.cpu()  # one copy per step, not one per row
        for j, i in enumerate(self.step_reqs):
            self.logits[i].update(zip(pos[cu[j]:cu[j + 1]], logits[cu[j]:cu[j + 1]]))
            s = self.slots[i]
            if self.st.num_computed[s] >= len(self.prompts[i]):  # prompt done (or decode): sample
                token = int(logits[cu[j + 1] - 1].argmax())
                self.generated[i].append(token)
                self.ops.append_tokens(s, [token])


def _gather_unmirror(rows: torch.Tensor, mine: InputMetadata) -> torch.Tensor:
    """Collective: every rank's mirror rows -> the full row order (``cpmeta.unmirror``)."""
    return cpmeta.unmirror(all_gather(rows), mine.mirror_cp_reverse_index)


def _write_slots(md: InputMetadata, cfg: MetadataConfig, rank: int) -> torch.Tensor:
    """[total_q] slots of the FULL-ORDER rows in this rank's cache (-1: not its key, placeholder)."""
    return cpmeta.cp.compute_slot_mapping_from_metadata(md, cfg, cp_rank=rank)  # KV sharding from cfg


def _pad(t: torch.Tensor, n: int, value: float) -> torch.Tensor:
    """``t`` [m, ...] padded to [n, ...] with ``value`` (n >= m): equal shapes for all_gather."""
    return torch.cat([t, t.new_full((n - t.shape[0], *t.shape[1:]), value)])


def prefill_step(model: Any, cache: PagedKVCache, md: InputMetadata, cfg: MetadataConfig,
                 rank: int, world: int) -> torch.Tensor:
    """Collective (every rank). Zigzag prefill of one chunked prompt step; returns the logits
    [total_q, vocab] of every row in full order (on every rank)."""
    dev = cache.k.device
    mine = cpmeta.prepare_for_mirror_cp(md, rank, world)
    ids = cpmeta.mirror_rows(md.input_ids, mine.mirror_cp_index, 0)
    pos = mine.positions.to(dev, torch.int64)
    # each row's sequence (query_indices: placeholders 998244353, whose keys nobody holds)
    row_seq = cpmeta.mirror_rows(md.query_indices, mine.mirror_cp_index, NO_GROUP).to(dev, torch.int64)
    slots = _write_slots(md, cfg, rank).to(dev)
    plan = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=rank)
    n_seq = plan.seqlens.shape[0]
    k_seq = torch.repeat_interleave(torch.arange(n_seq), plan.seqlens.long().cpu()).to(dev)
    labels = torch.stack([k_seq, plan.positions.to(dev, torch.int64)], dim=1)  # [n_local, 2]
    sharded = cfg.kv_cp_world_size > 1
    if sharded:  # every rank's keys, labelled; once per step (the same for every layer)
        labels = torch.cat(all_gather(_pad(labels, plan.max_total, NO_GROUP)))

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = _gather_unmirror(torch.stack([k, v], dim=1), mine)  # [total_q, 2, KVH, D] full order
        cache.write(layer, slots, kv[:, 0], kv[:, 1])
        keys, vals = cache.read(layer, plan.slots)  # history + this chunk held here
        if sharded:
            both = torch.cat(all_gather(_pad(torch.stack([keys, vals], dim=1), plan.max_total, 0.0)))
            keys, vals = both[:, 0], both[:, 1]
        out, _ = partial_attention(q, row_seq, pos, keys, vals, labels[:, 0], labels[:, 1])
        return out

    logits = forward_rows(model, ids, pos, attend)
    return _gather_unmirror(logits, mine)


def decode_step(model: Any, cache: PagedKVCache, md: InputMetadata, cfg: MetadataConfig,
                rank: int, world: int) -> torch.Tensor:
    """Collective (every rank). One decode step over interleaved KV; returns logits [total_q,
    vocab] (every rank computes every row; the attention is combined by LSE across ranks)."""
    dev = cache.k.device
    pos = md.positions.to(dev, torch.int64)
    rows = torch.arange(pos.shape[0], device=dev)
    slots = _write_slots(md, cfg, rank).to(dev)
    plan = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=rank)
    k_row = torch.repeat_interleave(rows.cpu(), plan.seqlens.long().cpu()).to(dev)
    k_pos = plan.positions.to(dev, torch.int64)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.write(layer, slots, k, v)  # the owner of the new key (slot != -1) stores it
        keys, vals = cache.read(layer, plan.slots)  # this rank's shard of every row's keys
        out, lse = partial_attention(q, rows, pos, keys, vals, k_row, k_pos)
        if cfg.kv_cp_world_size > 1:
            out = combine_lse(all_gather(out), all_gather(lse))
        return out

    return forward_rows(model, md.input_ids, pos, attend)


def _keep_going(flag: bool, device: torch.device) -> bool:
    """Collective: rank 0's ``flag`` on every rank (the broadcaster has no end-of-stream)."""
    return bool(broadcast(torch.tensor([int(flag)], device=device)).item())


def run_rank(rank: int, world: int, o: GenOptions) -> Optional[dict[str, Any]]:
    """Every rank of an initialised process group: the engine loop. Rank 0 returns the report of
    :func:`compare`, the others ``None``."""
    device = torch.device("cuda", 0) if o.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank on cuda:0 (NCCL world 1, or gloo ranks sharing it)
    cfg = make_config(o)
    model = build_model(DTYPES[o.dtype], device, o.seed)
    cache = PagedKVCache.allocate(model, o.num_blocks, cfg.block_size)
    if o.strategy == "replicate":
        return _run_replicated(rank, world, o, cfg, model, cache, device)
    driver = Driver(o, cfg, model.config.vocab_size) if rank == 0 else None
    with cpmeta.MetadataBroadcaster(src=0) as bc, torch.inference_mode():
        while True:
            md = driver.next_metadata() if driver is not None else None
            if not _keep_going(md is not None, device):
                break
            md = bc.broadcast(md)  # every rank: the driver's metadata, nothing else
            step = prefill_step if md.is_prompt else decode_step
            logits = step(model, cache, md, cfg, rank, world)
            if driver is not None:
                driver.accept(md, logits)
    return compare(model, driver, o) if driver is not None else None


def _run_replicated(rank: int, world: int, o: GenOptions, cfg: MetadataConfig, model: Any,
                    cache: PagedKVCache, device: torch.device) -> Optional[dict[str, Any]]:
    """``--strategy replicate``: every rank keeps the requests' ``BatchState``; the driver's
    scheduler records each step's calls, ``sync()`` sends them, every rank builds its own
    metadata from its replica (no metadata is moved)."""
    with cpmeta.ReplicatedBatchState(cfg, len(o.prompt_lens)) as rep, torch.inference_mode():
        driver = Driver(o, cfg, model.config.vocab_size, replicated=rep) if rank == 0 else None
        while True:
            more = driver.next_batch() is not None if driver is not None else False
            if not _keep_going(more, device):
                break
            md = build_metadata(rep.sync(), cfg)  # every rank: its own replica's batch
            step = prefill_step if md.is_prompt else decode_step
            logits = step(model, cache, md, cfg, rank, world)
            if driver is not None:
                driver.accept(md, logits)
    return compare(model, driver, o) if driver is not None else None


def build_metadata(batch: Any, cfg: MetadataConfig) -> InputMetadata:
    return cpmeta.prepare_prompt(batch, cfg) if batch.is_prompt else cpmeta.prepare_decode(batch, cfg)


def compare(model: Any, driver: Driver, o: GenOptions) -> dict[str, Any]:
    """The unmodified model in one process vs the CP run: tokens and every row's logits.

    ``teacher_forced_equal``: each CP token is the reference's argmax on the same inputs, at
    every step where the reference's top-2 margin exceeds twice the tolerance (a closer near-tie
    may flip between two correct runs of that precision; counted in ``near_ties``)."""
    tokens, ref_tokens, forced, near_ties = [], [], True, 0
    worst, tol = torch.zeros((), dtype=torch.float64), TOLERANCE[o.dtype]
    dev = model.lm_head.weight.device
    with torch.inference_mode():
        for i, prompt in enumerate(driver.prompts):
            p = torch.tensor([prompt], device=dev)
            ref = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=o.new_tokens,
                                 do_sample=False)[0, len(prompt):]  # mask: token 0 is the pad id
            got = driver.generated[i]
            full = torch.tensor([prompt + got[:-1]], device=dev)
            ref_logits = model(full).logits[0].cpu().double()  # teacher-forced on the CP tokens
            cp_logits = torch.stack([driver.logits[i][t] for t in range(full.shape[1])]).double()
            worst = torch.maximum(worst, (cp_logits - ref_logits).abs().max())  # NaN propagates
            top2 = ref_logits[len(prompt) - 1:].topk(2, dim=-1)
            decisive = top2.values[:, 0] - top2.values[:, 1] > 2 * tol
            forced &= bool((top2.indices[:, 0] == torch.tensor(got))[decisive].all())
            near_ties += int((~decisive).sum())
            tokens.append(got)
            ref_tokens.append(ref.tolist())
    diff = float(worst)
    equal = tokens == ref_tokens
    ok = diff <= tol and (equal if o.dtype == "float64" else forced)
    return {"tokens": tokens, "generate_tokens": ref_tokens, "tokens_equal_generate": equal,
            "teacher_forced_equal": forced, "near_ties": near_ties, "max_logit_diff": diff,
            "tolerance": tol, "ok": ok, "options": dataclasses.asdict(o)}


def _rank(rank: int, world: int, o: GenOptions) -> Optional[dict[str, Any]]:
    """One spawned rank (its process group initialised by ``run_ranks``): rank 0's report."""
    torch.set_num_threads(1)
    result = run_rank(rank, world, o)
    dist.barrier()  # followers wait while rank 0 compares: every rank tears down together
    return result


def launch(o: GenOptions) -> dict[str, Any]:
    """Run the example on ``o.cp`` local processes; returns rank 0's report. Starting them is
    ``cpmeta.testing.run_ranks`` (part of the wheel: free port, process group, one deadline, the
    failing rank's traceback, exit without interpreter teardown)."""
    from cpmeta.testing import run_ranks

    for k, v in launch_envs.MULTICAST_OFF.items():  # as python -m cpmeta.launch: NVLink multicast off
        launch_envs.set_default(k, v)  # before the spawn: the ranks inherit it
    backend = "nccl" if o.device == "cuda" and o.cp == 1 else "gloo"
    return run_ranks(_rank, o.cp, o, backend=backend, timeout=300)[0]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--config", choices=("plain", "seed"), default="plain")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--json", dest="json", help="also write the report here (JSON with the run block)")
    p.add_argument("--strategy", choices=("broadcast", "replicate"), default="broadcast",
                   help="broadcast the driver's metadata, or replicate the step and build on every rank")
    a = p.parse_args(argv)
    if a.cp < 1 or a.interleave < 1 or a.chunk < 1 or a.new_tokens < 1:
        p.error("--cp, --interleave, --chunk and --new-tokens must be >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if importlib.util.find_spec("transformers") is None:
        p.error("needs transformers: pip install 'transformers>=4.48' (or pip install -e '.[test]')")
    o = GenOptions(cp=a.cp, interleave=a.interleave, dtype=a.dtype, device=a.device,
                   config=a.config, new_tokens=a.new_tokens, chunk=a.chunk, seed=a.seed,
                   strategy=a.strategy)
    try:
        make_config(o)  # bad combinations (interleave not dividing the block size, ...) stop here
    except ValueError as e:
        p.error(str(e))
    r = launch(o)
    print(f"cp={o.cp} interleave={o.interleave} dtype={o.dtype} device={o.device} config={o.config}")
    for i, (got, ref) in enumerate(zip(r["tokens"], r["generate_tokens"])):
        print(f"request {i}: cp tokens {got}  generate {ref}  {'==' if got == ref else '!='}")
    print(f"tokens equal generate: {r['tokens_equal_generate']}; teacher-forced argmax equal: "
          f"{r['teacher_forced_equal']} ({r['near_ties']} near-ties skipped); max |logit diff| {r['max_logit_diff']:.3g} "
          f"(tolerance {r['tolerance']:g}) -> {'OK' if r['ok'] else 'MISMATCH'}")
    if a.json:
        write_result(a.json, r, argv)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
