"""The model side of ``scripts/cp_generate.py``: a HuggingFace Llama driven row by row, paged KV.

Nothing here knows about the scheduler or the broadcast: it takes rows (token ids, positions),
a per-rank paged KV cache and an ``attend`` callback, and runs the unmodified HF modules of
``transformers``' ``LlamaForCausalLM`` around it -- ``embed_tokens``, per decoder layer the
``input_layernorm``, ``q_proj`` / ``k_proj`` / ``v_proj``, rotary embedding at the rows'
positions (``rotary_emb`` + ``apply_rotary_pos_emb``), ``o_proj``, ``post_attention_layernorm``,
``mlp``; then ``norm`` and ``lm_head``. Only the attention computation is replaced:
:func:`partial_attention` (softmax over the keys a row may see, with its log-sum-exp) and
:func:`combine_lse` (merge of several ranks' partial results).

Shapes: ``R`` rows, ``H`` query heads, ``KVH`` KV heads, ``D`` head dim, ``N`` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["TINY_LLAMA", "build_model", "PagedKVCache", "partial_attention", "combine_lse",
           "forward_rows", "NO_GROUP"]

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


@dataclass
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
