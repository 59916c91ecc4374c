"""Valid random configs and batches for the builder, mirror, YoCo and broadcast tests.

Two front ends share ONE generator so a failing hypothesis example and a seeded run explore the
same space:

- plain seeded generators, for loops inside spawned ranks or benchmarks::

      rng = random.Random(7)
      cfg = random_config(rng)
      seqs = random_prompt_batch(rng, cfg)          # list[SequenceMetadata], always valid
      dec = random_decode_batch(rng, cfg, max_drafts=2)

- hypothesis strategies (the same generators drawing through ``data.draw``, so examples shrink)::

      @given(case=prompt_cases())                   # (cfg, seqs)
      def test_x(case): cfg, seqs = case

Every batch passes ``cpmeta.sequence.validate_batch``. What the generators cover (each with a
fair probability): first chunk (``q_start == 0``), chunked prefill with ``q_start < W`` and
``q_start > W``, ``seqlen_k`` below the smallest ratio, SWA ring wrap (``S`` small against the
positions), ``swa_valid_start > 0`` (also beyond the chunk), placeholders, MTP drafts (decode),
Engram (``max_ngram_size > 0`` with an ``ngram_lookup`` table, an image sentinel inside the
tokens and a ``compressed_token_ids`` history), prompt ``token_ids`` longer than ``seqlen_k``
(the whole prompt, as YoCo needs), and ratio sets including ``1``, ``block_size`` itself, an
empty dense or sparse tuple, no ratios at all (no compressed KV), ``window_size = 0`` (no
sliding window), and both (a plain paged-KV model, docs/design.md section 14), its KV sharded over the CP
group or not.

The generators only call ``rng.randint(a, b)`` (inclusive), ``rng.choice(seq)`` and
``rng.random()``; bulk lists (tokens, block ids) come from a ``random.Random`` seeded by one draw.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Protocol, Sequence, TypeVar

import torch

from cpmeta.config import MetadataConfig, blocks_needed
from cpmeta.metadata import InputMetadata
from cpmeta.sequence import SequenceMetadata

__all__ = [
    "random_config",
    "random_prompt_batch",
    "random_decode_batch",
    "configs",
    "prompt_cases",
    "decode_cases",
    "metadata_prefix",
    "DEFAULT_VOCAB",
]

T = TypeVar("T")

#: Raw token ids are drawn from ``[0, DEFAULT_VOCAB)``; ``ngram_lookup`` has this many entries.
DEFAULT_VOCAB = 97
#: Compressed (Engram) ids are drawn from ``[0, COMPRESSED_VOCAB)``.
COMPRESSED_VOCAB = 61
#: Physical block ids are drawn from ``[0, MAX_BLOCK_ID]``.
MAX_BLOCK_ID = 4000
#: State slots are drawn from ``[0, MAX_STATE_ID]``.
MAX_STATE_ID = 500
#: Keeps the per-token reference (and hence every test) fast.
DEFAULT_MAX_TOTAL_Q = 160
#: Chance that :func:`random_config` draws a plain paged-KV model (no ratios, ``window_size = 0``:
#: docs/design.md section 14); otherwise it switches compressed KV off, and independently the sliding-window state
#: cache, each with :data:`FEATURE_OFF_CHANCE`.
PLAIN_CHANCE = 0.1
FEATURE_OFF_CHANCE = 0.15


class Rng(Protocol):
    """The three calls the generators make (``random.Random`` satisfies it)."""

    def randint(self, a: int, b: int) -> int: ...
    def choice(self, seq: Sequence[T]) -> T: ...
    def random(self) -> float: ...


def _sub(rng: Rng) -> random.Random:
    """A plain ``random.Random`` for bulk lists, seeded by one draw of ``rng``."""
    return random.Random(rng.randint(0, 2**32 - 1))


def _chance(rng: Rng, p: float) -> bool:
    return rng.random() < p


# ---- config ---------------------------------------------------------------------------------


def _ratio_subset(rng: Rng, divisors: list[int]) -> tuple[int, ...]:
    k = rng.choice([0, 1, 1, 1, 2, 2, 3])
    picked: list[int] = []
    for _ in range(k):
        r = rng.choice(divisors)
        if r not in picked:
            picked.append(r)
    return tuple(picked)


def random_config(rng: Rng, **overrides: Any) -> MetadataConfig:
    """A small random valid :class:`MetadataConfig` (``overrides`` win over the random values).

    Sizes are small so expanded indices stay cheap: ``block_size`` in 4..128, ``W`` 1..40 (or 0:
    no sliding window), ``S - W`` in 0..9, ``max_model_len`` 1..1024; a plain paged-KV model
    with :data:`PLAIN_CHANCE`, else compressed KV off (no ratios) with
    :data:`FEATURE_OFF_CHANCE`, and so, independently, the sliding window;
    without compressed KV (and no ratio override) the KV is sharded over 2-4 CP ranks 40% of the
    time (``kv_cp_interleave`` a divisor of ``block_size`` up to 8). Example:
    ``random_config(rng, yoco_keep_tokens=16, yoco_mode="mask")``.
    """
    bs = rng.choice([4, 8, 16, 16, 32, 64, 128])
    divisors = [d for d in range(1, bs + 1) if bs % d == 0]
    dense = _ratio_subset(rng, divisors)
    sparse = _ratio_subset(rng, divisors)
    plain = _chance(rng, PLAIN_CHANCE)
    compressed = not plain and not _chance(rng, FEATURE_OFF_CHANCE)  # off: no compressed KV at all
    if not compressed:
        dense = sparse = ()
    elif not dense and not sparse:
        sparse = (rng.choice(divisors),)
    w = rng.choice([1, 2, 3, 4, 5, 8, 8, 13, 16, 32, 40])
    s = w + rng.choice([0, 0, 1, 2, 3, 9])
    if overrides.get("yoco_keep_tokens") is None and (plain or _chance(rng, FEATURE_OFF_CHANCE)):
        w = 0  # no sliding-window state cache (YoCo needs one)
    ngram = rng.choice([0, 0, 1, 2, 3])
    lookup: Optional[torch.Tensor] = None
    if ngram and _chance(rng, 0.7):
        sub = _sub(rng)
        lookup = torch.tensor([sub.randrange(COMPRESSED_VOCAB) for _ in range(DEFAULT_VOCAB)],
                              dtype=torch.int32)
    kw: dict[str, Any] = dict(
        block_size=bs,
        window_size=w,
        swa_block_size=s,
        dense_compress_ratios=dense,
        sparse_compress_ratios=sparse,
        max_model_len=rng.choice([64, 200, 256, 512, 1000, 1024]),
        max_ngram_size=ngram,
        ngram_pad_token=rng.choice([0, 0, 1000]),
        ngram_lookup=lookup,
        image_token_id=rng.choice([None, 5]) if ngram else rng.choice([None, None, 5]),
        force_load_balance=_chance(rng, 0.3),
    )
    if not compressed and not {"dense_compress_ratios", "sparse_compress_ratios"} & set(overrides) \
            and _chance(rng, 0.4):  # a plain model's KV sharded over the CP group (tables of rank 0's share)
        kw["kv_cp_world_size"] = rng.choice([2, 3, 4])
        kw["kv_cp_interleave"] = rng.choice([d for d in divisors if d <= 8])
    kw.update(overrides)
    return MetadataConfig(**kw)


# ---- sequences ------------------------------------------------------------------------------


def _tokens(rng: Rng, cfg: MetadataConfig, n: int) -> list[int]:
    sub = _sub(rng)
    toks = [sub.randrange(DEFAULT_VOCAB) for _ in range(n)]
    img = cfg.image_token_id
    if img is not None:
        toks = [t if t != img else img + 1 for t in toks]  # sentinels only where placed below
        for _ in range(sub.choice([0, 0, 1, 2])):
            if n:
                toks[sub.randrange(n)] = img
    return toks


def _block_table(rng: Rng, cfg: MetadataConfig, seqlen_k: int) -> list[int]:
    sub = _sub(rng)
    n = blocks_needed(seqlen_k, cfg) + sub.choice([0, 0, 1, 3])
    return sub.sample(range(MAX_BLOCK_ID + 1), n)


def _seqlen_k(rng: Rng, cfg: MetadataConfig, cap: int) -> int:
    """Biased towards the interesting boundaries: below min ratio, around W and S, multiples."""
    m, w, s = cfg.min_ratio, cfg.window_size, cfg.swa_block_size
    lo_pick = rng.choice(["tiny", "w", "s", "any", "any", "mult"])
    if lo_pick == "tiny":
        k = rng.randint(1, max(1, m))
    elif lo_pick == "w":
        k = w + rng.randint(-1, 2)
    elif lo_pick == "s":
        k = 2 * s + rng.randint(-2, 2)
    elif lo_pick == "mult":
        k = m * rng.randint(1, 8) + rng.choice([-1, 0, 0, 1])
    else:
        k = rng.randint(1, cap)
    return max(1, min(k, cap, cfg.max_model_len))


def _engram_history(rng: Rng, cfg: MetadataConfig, seqlen_k: int) -> list[int]:
    if not cfg.max_ngram_size or not _chance(rng, 0.7):
        return []
    sub = _sub(rng)
    return [sub.randrange(COMPRESSED_VOCAB) for _ in range(sub.randint(0, seqlen_k))]


def _state_ids(rng: Rng, n: int) -> list[int]:
    return _sub(rng).sample(range(MAX_STATE_ID + 1), n)


def _swa_valid_start(rng: Rng, seqlen_k: int) -> int:
    if not _chance(rng, 0.3):
        return 0
    return rng.randint(1, seqlen_k + 2)


def random_prompt_batch(
    rng: Rng,
    cfg: MetadataConfig,
    *,
    n_seqs: Optional[int] = None,
    max_total_q: int = DEFAULT_MAX_TOTAL_Q,
    placeholders: bool = True,
    whole_prompt: Optional[bool] = None,
) -> list[SequenceMetadata]:
    """A valid prompt batch (``validate_batch(..., is_prompt=True)`` passes).

    ``n_seqs`` defaults to 1..6; ``sum(seqlen_q) <= max_total_q`` (at least one row per
    sequence). ``q_start`` is 0 (first chunk) in about a third of the sequences. ``token_ids``
    holds ``seqlen_k`` tokens, or the whole prompt (longer; YoCo needs this) when
    ``whole_prompt`` is True (None: random). Example: ``random_prompt_batch(random.Random(0),
    cfg, n_seqs=2)``.
    """
    n = n_seqs if n_seqs is not None else rng.randint(1, 6)
    budget = max(max_total_q, n)
    states = _state_ids(rng, n)
    seqs = []
    for i in range(n):
        rows_left = budget - (n - i - 1)
        k = _seqlen_k(rng, cfg, cap=cfg.max_model_len)
        first = _chance(rng, 0.35)
        q_hi = min(k, rows_left)
        q = q_hi if first else rng.randint(1, q_hi)
        if first and q < k:  # row budget too small for a first chunk: shrink the sequence
            k = q
        budget -= q
        extra = 0
        whole = whole_prompt if whole_prompt is not None else _chance(rng, 0.3)
        if whole:
            extra = rng.randint(0, max(0, min(40, cfg.max_model_len - k)))
        seqs.append(SequenceMetadata(
            seqlen_q=q,
            seqlen_k=k,
            block_table=_block_table(rng, cfg, k),
            state_id=states[i],
            token_ids=_tokens(rng, cfg, k + extra),
            is_placeholder=placeholders and _chance(rng, 0.15),
            swa_valid_start=_swa_valid_start(rng, k),
            compressed_token_ids=_engram_history(rng, cfg, k),
        ))
    return seqs


def random_decode_batch(
    rng: Rng,
    cfg: MetadataConfig,
    *,
    n_seqs: Optional[int] = None,
    max_drafts: int = 3,
    placeholders: bool = True,
) -> list[SequenceMetadata]:
    """A valid decode batch (``validate_batch(..., is_prompt=False)`` passes).

    ``n_seqs`` defaults to 1..8; each sequence has ``seqlen_q = 1 + d`` rows with ``d`` in
    ``0..max_drafts`` MTP drafts (all sequences share one ``d`` half of the time),
    ``seqlen_k - seqlen_q + 1`` confirmed tokens. Example: ``seqlen_q=3, seqlen_k=10``:
    8 tokens, 2 drafts, rows at positions 7, 8, 9.
    """
    n = n_seqs if n_seqs is not None else rng.randint(1, 8)
    shared_d = rng.randint(0, max_drafts) if _chance(rng, 0.5) else None
    states = _state_ids(rng, n)
    seqs = []
    for i in range(n):
        d = shared_d if shared_d is not None else rng.randint(0, max_drafts)
        q = min(1 + d, cfg.max_model_len)
        k = max(q, _seqlen_k(rng, cfg, cap=cfg.max_model_len))
        toks = _tokens(rng, cfg, k - q + 1 + (q - 1))
        seqs.append(SequenceMetadata(
            seqlen_q=q,
            seqlen_k=k,
            block_table=_block_table(rng, cfg, k),
            state_id=states[i],
            token_ids=toks[: k - q + 1],
            is_placeholder=placeholders and _chance(rng, 0.15),
            swa_valid_start=_swa_valid_start(rng, k),
            draft_tokens=toks[k - q + 1:],
            compressed_token_ids=_engram_history(rng, cfg, k),
        ))
    return seqs


# ---- hypothesis front end -------------------------------------------------------------------


class _DrawRng:
    """Adapts hypothesis ``data.draw`` to the :class:`Rng` protocol (examples shrink)."""

    def __init__(self, draw: Any) -> None:
        from hypothesis import strategies as st

        self._draw, self._st = draw, st

    def randint(self, a: int, b: int) -> int:
        return self._draw(self._st.integers(a, b))

    def choice(self, seq: Sequence[T]) -> T:
        return self._draw(self._st.sampled_from(list(seq)))

    def random(self) -> float:
        return self._draw(self._st.integers(0, 999)) / 1000.0


def configs(**overrides: Any) -> Any:
    """Hypothesis strategy of :func:`random_config` configs."""
    from hypothesis import strategies as st

    @st.composite
    def _cfg(draw: Any) -> MetadataConfig:
        return random_config(_DrawRng(draw), **overrides)

    return _cfg()


def prompt_cases(config_overrides: Optional[dict[str, Any]] = None, **batch_kw: Any) -> Any:
    """Hypothesis strategy of ``(cfg, seqs)`` prompt cases (``batch_kw`` go to the generator)."""
    from hypothesis import strategies as st

    @st.composite
    def _case(draw: Any) -> tuple[MetadataConfig, list[SequenceMetadata]]:
        rng = _DrawRng(draw)
        cfg = random_config(rng, **(config_overrides or {}))
        return cfg, random_prompt_batch(rng, cfg, **batch_kw)

    return _case()


def decode_cases(config_overrides: Optional[dict[str, Any]] = None, **batch_kw: Any) -> Any:
    """Hypothesis strategy of ``(cfg, seqs)`` decode cases (``batch_kw`` go to the generator)."""
    from hypothesis import strategies as st

    @st.composite
    def _case(draw: Any) -> tuple[MetadataConfig, list[SequenceMetadata]]:
        rng = _DrawRng(draw)
        cfg = random_config(rng, **(config_overrides or {}))
        return cfg, random_decode_batch(rng, cfg, **batch_kw)

    return _case()


def metadata_prefix(md: InputMetadata, n: int, tq: int) -> InputMetadata:
    """``md`` cut to the first ``tq`` rows / ``n + 1`` cu entries, with the batch scalars set.

    Reads the live prefix of metadata written into buffers captured for a larger batch.
    """
    changes: dict[str, Any] = {}
    for name in InputMetadata.field_names():
        v = getattr(md, name)
        if isinstance(v, torch.Tensor):
            changes[name] = v[: n + 1] if name.startswith("cu_seqlens") else v[:tq]
        elif isinstance(v, dict):
            changes[name] = {k: x[:tq] for k, x in v.items()}
    cu_q, cu_k = md.cu_seqlens_q[: n + 1], md.cu_seqlens_k[: n + 1]
    changes.update(num_seqs=n, total_q=tq, max_seqlen_q=int((cu_q[1:] - cu_q[:-1]).max()),
                   max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()))
    return md.replace(**changes)
