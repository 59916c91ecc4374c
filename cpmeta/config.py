"""``MetadataConfig``: the model/cache constants every builder reads, and :func:`blocks_needed`.

The block rule lives here (the lowest module) because the config's own decode table width is
that rule at ``max_model_len``; the sequence validation and the array-level state import it.
Its three forms sit together: :func:`blocks_needed` (int), :func:`blocks_needed_array` (numpy),
:func:`blocks_needed_tensor` (torch, any device), and the inverse :func:`seqlen_k_covered`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .constants import INT32_MAX

__all__ = ["MetadataConfig", "YOCO_MODES", "check_config", "blocks_needed", "blocks_needed_array",
           "blocks_needed_tensor", "seqlen_k_covered"]

YOCO_MODES = ("mask", "compact")

#: The int-valued fields (``None`` allowed where the field is optional). A numpy integer given
#: for one is stored as the equal Python int before any check, so every later reader (the
#: builders, msgpack, ``==``) sees one kind: ``MetadataConfig(block_size=np.int64(16)).block_size``
#: is the int 16.
_INT_FIELDS = ("block_size", "window_size", "swa_block_size", "max_model_len", "max_ngram_size",
               "ngram_pad_token", "image_token_id", "yoco_keep_tokens", "kv_cp_world_size",
               "kv_cp_interleave")


#: :meth:`MetadataConfig.compressed_swa`'s values (the fields it sets; the rest keep their defaults).
_COMPRESSED_SWA: dict[str, Any] = {"block_size": 128, "window_size": 128, "swa_block_size": 128,
                                   "dense_compress_ratios": (4,), "sparse_compress_ratios": (4,)}


def _is_int(x: object) -> bool:
    """A Python or numpy integer (``np.int64(7)`` counts; ``True`` and ``np.True_`` do not)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _ratio_tuple(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a tuple of positive ints, got {value!r}")
    out = tuple(value)
    for r in out:
        if not _is_int(r) or not 1 <= r <= INT32_MAX:
            raise ValueError(f"{name}: expected ints in [1, 2**31 - 1], got {r!r} in {out!r}")
    out = tuple(map(int, out))  # numpy integers become Python ints: the config holds one kind
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: ratio listed twice in {out!r}")
    return out


@dataclass(frozen=True, slots=True)
class MetadataConfig:
    """Model and cache constants for one engine (validated on construction).

    The defaults are a plain paged-KV model (Llama, Qwen, Mistral, ...): 16-token blocks (vLLM's
    default block size on GPUs), 8192 tokens per sequence (pass your engine's
    ``max_model_len``; it sizes the decode ``block_tables``: ``cdiv(8192, 16) = 512`` columns),
    no compressed KV, no sliding window. ``MetadataConfig(block_size=16, max_model_len=4096)`` is
    a plain model of 4096 tokens: a block holds ``block_size`` uncompressed tokens and every rule
    that uses the smallest ratio uses 1 (``min_ratio == 1``).

    Features are switched by the config (docs/design.md section 14): compressed KV (``ca_ratios``
    non-empty), the sliding-window state cache (``window_size > 0``), Engram
    (``max_ngram_size > 0``) and YoCo (``yoco_keep_tokens`` set; it limits the sliding window,
    so it needs ``window_size > 0``). :meth:`compressed_swa` is the compressed-KV +
    sliding-window model (block 128, ratios 4, window 128).

    ``ca_ratios`` is the sorted union of dense and sparse compression ratios; every ratio must
    divide ``block_size``. Dict-valued metadata fields are keyed by ``str(ratio)``.
    Example: ``MetadataConfig(block_size=128, dense_compress_ratios=(4, 128),
    sparse_compress_ratios=(4,))`` has ``ca_ratios == (4, 128)`` and ``min_ratio == 4``.

    KV sharded over the CP group (plain configs only for now): ``kv_cp_world_size=W`` ranks each
    hold the positions ``p`` with ``(p // kv_cp_interleave) % W == rank`` in their paged cache, so
    tables are sized for rank 0's share (the largest): ``W=3, I=1, block_size=16,
    max_model_len=300`` -> rank 0 holds 100 keys -> ``max_num_blocks == 7``.
    """

    block_size: int = 16  # paged KV block size, in tokens of the uncompressed sequence
    window_size: int = 0  # W: sliding-window length (0 = no sliding-window state cache)
    swa_block_size: int = 128  # S: SWA ring length per state slot, S >= W (read only when W > 0)
    dense_compress_ratios: tuple[int, ...] = ()  # ratios n of core-attention compressed KV
    sparse_compress_ratios: tuple[int, ...] = ()  # ratios r of top-k sparse compressed KV
    max_model_len: int = 8192  # max tokens per sequence
    max_ngram_size: int = 0  # Engram look-back width (0 = off)
    ngram_pad_token: int = 0  # pad id written into ngram_token_ids
    ngram_lookup: Optional[torch.Tensor] = field(default=None, compare=False)  # [vocab] int
    image_token_id: Optional[int] = None  # image sentinel id
    force_load_balance: bool = False  # value of gate_force_random
    yoco_keep_tokens: Optional[int] = None  # YoCo: consumer layers keep the last k tokens
    yoco_mode: str = "compact"  # "mask" or "compact"
    kv_cp_world_size: int = 1  # ranks the paged KV is sharded over (1 = every rank holds every key)
    kv_cp_interleave: int = 1  # consecutive positions per rank before the next (divides block_size)
    # derived constants, computed once in __post_init__ (the builders read them every step; a
    # property recomputing them cost ~2-4 us per read)
    _ca: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _min_ratio: int = field(default=1, init=False, repr=False, compare=False)
    _max_num_blocks: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            if isinstance(getattr(self, name), np.integer):
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("block_size", "swa_block_size", "max_model_len", "kv_cp_world_size",
                     "kv_cp_interleave"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= INT32_MAX:
                raise ValueError(f"{name}: expected an int in [1, 2**31 - 1], got {v!r}")
        if not _is_int(self.window_size) or not 0 <= self.window_size <= INT32_MAX:
            raise ValueError(f"window_size: expected an int in [0, 2**31 - 1] (0 = off), got {self.window_size!r}")
        if self.swa_block_size < self.window_size:
            raise ValueError(
                f"swa_block_size: expected >= window_size ({self.window_size}), "
                f"got {self.swa_block_size}"
            )
        dense = _ratio_tuple("dense_compress_ratios", self.dense_compress_ratios)
        sparse = _ratio_tuple("sparse_compress_ratios", self.sparse_compress_ratios)
        object.__setattr__(self, "dense_compress_ratios", dense)
        object.__setattr__(self, "sparse_compress_ratios", sparse)
        ca = tuple(sorted(set(dense) | set(sparse)))
        object.__setattr__(self, "_ca", ca)
        object.__setattr__(self, "_min_ratio", ca[0] if ca else 1)
        for n in self.ca_ratios:
            if self.block_size % n:
                which = "dense_compress_ratios" if n in dense else "sparse_compress_ratios"
                raise ValueError(f"{which}: ratio {n} does not divide block_size {self.block_size}")
        self._check_kv_sharding()
        object.__setattr__(self, "_max_num_blocks", blocks_needed(self.max_model_len, self))
        self._check_features()

    def _check_kv_sharding(self) -> None:
        if self.block_size % self.kv_cp_interleave:
            raise ValueError(
                f"kv_cp_interleave: expected a divisor of block_size ({self.block_size}), "
                f"got {self.kv_cp_interleave}"
            )
        if self._ca and self.kv_cp_world_size > 1:
            raise ValueError(
                f"kv_cp_world_size: compressed KV (ca_ratios={self._ca}) sharded over the CP group "
                f"is not supported until defined; expected 1, got {self.kv_cp_world_size}"
            )

    def _check_features(self) -> None:
        if not _is_int(self.max_ngram_size) or not 0 <= self.max_ngram_size <= INT32_MAX:
            raise ValueError(f"max_ngram_size: expected an int >= 0, got {self.max_ngram_size!r}")
        if not _is_int(self.ngram_pad_token) or abs(self.ngram_pad_token) > INT32_MAX:
            raise ValueError(f"ngram_pad_token: expected an int32 value, got {self.ngram_pad_token!r}")
        if self.ngram_lookup is not None:
            t = self.ngram_lookup
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point:
                raise ValueError("ngram_lookup: expected a 1-D integer tensor or None")
            if t.numel() == 0:  # maps no token: every read would be outside it
                raise ValueError("ngram_lookup: an empty table maps no token id (None reads the ids "
                                 "themselves)")
        if self.image_token_id is not None and (
            not _is_int(self.image_token_id) or abs(self.image_token_id) > INT32_MAX
        ):
            raise ValueError(f"image_token_id: expected an int or None, got {self.image_token_id!r}")
        if not isinstance(self.force_load_balance, bool):
            raise ValueError(f"force_load_balance: expected a bool, got {self.force_load_balance!r}")
        k = self.yoco_keep_tokens
        if k is not None and (not _is_int(k) or not 1 <= k <= INT32_MAX):
            raise ValueError(f"yoco_keep_tokens: expected an int in [1, 2**31 - 1] or None, got {k!r}")
        if self.yoco_mode not in YOCO_MODES:
            raise ValueError(f"yoco_mode: expected one of {YOCO_MODES}, got {self.yoco_mode!r}")
        if k is not None and self.window_size == 0:
            # docs/design.md section 10: YoCo's rectangle limits the sliding-window keys (and only those)
            raise ValueError(
                f"yoco_keep_tokens: YoCo limits the sliding window, so it needs window_size > 0; "
                f"got yoco_keep_tokens={k} with window_size=0"
            )

    @classmethod
    def compressed_swa(cls, **overrides: Any) -> "MetadataConfig":
        """The compressed-KV + sliding-window model (DeepSeek-V4-like): core-attention and top-k
        sparse compressed KV at ratio 4 (``dense_compress_ratios=(4,)``,
        ``sparse_compress_ratios=(4,)``), a 128-token sliding window kept in a 128-slot state ring
        per sequence (``window_size=128``, ``swa_block_size=128``), 128-token blocks (every ratio
        must divide ``block_size``); ``overrides`` replace any of these or set the other fields.

        Example: ``MetadataConfig.compressed_swa(max_ngram_size=3)`` adds Engram; its
        ``min_ratio == 4`` and ``max_num_blocks == cdiv(8192 // 4, 128 // 4) == 64``.
        """
        return cls(**{**_COMPRESSED_SWA, **overrides})

    @property
    def ca_ratios(self) -> tuple[int, ...]:
        """Sorted union of dense and sparse ratios (``()`` without compressed KV)."""
        return self._ca

    @property
    def min_ratio(self) -> int:
        """Smallest ratio in ``ca_ratios``, or 1 without compressed KV (a block holds
        ``block_size`` uncompressed tokens)."""
        return self._min_ratio

    @property
    def max_num_blocks(self) -> int:
        """Columns of decode ``block_tables``: ``blocks_needed(max_model_len, self)``, i.e.
        ``cdiv(max_model_len // m, block_size // m)`` (m = ``min_ratio``) of rank 0's KV share.

        Examples: defaults (plain, block 16, 8192 tokens) -> 512; :meth:`compressed_swa` ->
        ``cdiv(8192 // 4, 128 // 4) = cdiv(2048, 32) = 64``; plain, block 16, 4096 tokens -> 256;
        plain, block 16, 300 tokens, ``kv_cp_world_size=3`` -> rank 0 holds 100 -> 7."""
        return self._max_num_blocks

    @property
    def max_block_id(self) -> int:
        """The largest block id whose KV slots fit int32: ``(2**31 - 1 - (b_c - 1)) // b_c``,
        ``b_c = block_size // min_ratio`` (slot ``id * b_c + c % b_c``: the compressed-KV write
        slot, or a plain config's paged-KV slot with ``b_c = block_size``).

        Examples: :meth:`compressed_swa`, ``b_c = 128 // 4 = 32`` -> ``2**26 - 1 = 67108863`` (id
        ``2**26`` reaches slot ``2**31``); defaults (plain, block 16) -> ``2**27 - 1``."""
        bc = self.block_size // self._min_ratio
        return (INT32_MAX - (bc - 1)) // bc

    @property
    def max_state_id(self) -> int:
        """The largest state id whose SWA ring slots fit int32: ``(2**31 - 1 - (S - 1)) // S``,
        ``S = swa_block_size`` (slot ``state_id * S + pos % S``). Binding only with the sliding-
        window state cache (``has_swa``). Example: ``S = 128`` -> ``2**24 - 1 = 16777215``."""
        S = self.swa_block_size
        return (INT32_MAX - (S - 1)) // S

    @property
    def has_compressed_kv(self) -> bool:
        """Compressed KV (``positions_c``, ``slot_mapping_store_ca``, ...): ``ca_ratios`` non-empty."""
        return bool(self._ca)

    @property
    def has_swa(self) -> bool:
        """The sliding-window state cache (``slot_mapping_store_swa``, pivots, ...): ``window_size > 0``."""
        return self.window_size > 0

    @property
    def has_engram(self) -> bool:
        """Engram look-back (``ngram_token_ids``): ``max_ngram_size > 0``."""
        return self.max_ngram_size > 0

    @property
    def has_yoco(self) -> bool:
        """YoCo prefill truncation (section 10 fields): ``yoco_keep_tokens`` is set."""
        return self.yoco_keep_tokens is not None

    @property
    def kv_sharded(self) -> bool:
        """Each rank's paged cache holds only its interleaved share: ``kv_cp_world_size > 1``."""
        return self.kv_cp_world_size > 1

    def attn_index_width(self, n: int) -> int:
        """Width of ``kv_ca_index[str(n)]``: ``cdiv(max_model_len // n, 128) * 128``."""
        from .constants import ATTN_INDEX_ALIGN

        return -(-(self.max_model_len // n) // ATTN_INDEX_ALIGN) * ATTN_INDEX_ALIGN


# ---- the one block rule (docs/design.md sections 3 and 14) -------------------------------------------


def check_config(cfg: object) -> None:
    """``TypeError`` naming ``cfg`` unless it is a :class:`MetadataConfig` (a wrong object would
    fail later on an attribute it lacks, naming nothing)."""
    if type(cfg) is not MetadataConfig and not isinstance(cfg, MetadataConfig):
        raise TypeError(f"cfg: expected a MetadataConfig, got {type(cfg).__name__}")


def blocks_needed(seqlen_k: int, cfg: MetadataConfig) -> int:
    """Blocks a sequence's table must hold for ``seqlen_k`` keys (the rule the builders validate).

    ``L`` = the keys of the largest KV share, rank 0's (``seqlen_k`` itself unless
    ``kv_cp_world_size = W > 1``; with ``I = kv_cp_interleave``:
    ``L = (k // (W*I)) * I + min(k % (W*I), I)``), then
    ``max over n in ca_ratios of cdiv(L // n, block_size // n)``, which (every ratio divides
    ``block_size``) is ``L // block_size + (L % block_size >= min_ratio)``; without ratios
    (``min_ratio = 1``) that is ``cdiv(L, block_size)``.

    Examples:
    - plain, block 16, 17 tokens -> ``cdiv(17, 16) = 2``;
    - plain, ``W=3, I=1``, block 16, 300 tokens -> rank 0 holds 100 -> ``cdiv(100, 16) = 7``;
    - ``W=2, I=16``, block 16, 40 tokens -> rank 0 holds 0..15 and 32..39 = 24 -> 2;
    - block 128, ratios (4, 128), 300 tokens -> ratio 4: ``cdiv(75, 32) = 3``, ratio 128:
      ``cdiv(2, 1) = 2`` -> 3 (closed form: ``2 + (44 >= 4)``).

    ``seqlen_k`` is an int (a numpy integer counts) ``>= 0``: anything else is a ``TypeError`` /
    ``ValueError`` naming it (a float or a negative count has no block rule; the array forms
    below stay unchecked, their callers validate the arrays once).
    """
    if not _is_int(seqlen_k):
        raise TypeError(f"seqlen_k: expected an int, got {seqlen_k!r}")
    if seqlen_k < 0:
        raise ValueError(f"seqlen_k: expected >= 0, got {seqlen_k}")
    k = int(seqlen_k)
    if cfg.kv_cp_world_size > 1:
        cycle, inter = cfg.kv_cp_world_size * cfg.kv_cp_interleave, cfg.kv_cp_interleave
        k = (k // cycle) * inter + min(k % cycle, inter)
    q, r = divmod(k, cfg.block_size)
    return q + (r >= cfg.min_ratio)


def blocks_needed_array(sk: np.ndarray, cfg: MetadataConfig) -> np.ndarray:
    """:func:`blocks_needed` of every entry of an integer array (same shape, int64 for int64 in).

    Example: plain, block 16, ``sk = [17, 16, 0]`` -> ``[2, 1, 0]``."""
    if cfg.kv_cp_world_size > 1:
        cycle, inter = cfg.kv_cp_world_size * cfg.kv_cp_interleave, cfg.kv_cp_interleave
        sk = (sk // cycle) * inter + np.minimum(sk % cycle, inter)
    return sk // cfg.block_size + (sk % cfg.block_size >= cfg.min_ratio)


def blocks_needed_tensor(seqlen_k: torch.Tensor, cfg: MetadataConfig) -> torch.Tensor:
    """:func:`blocks_needed` of every entry of an integer tensor, on its device (same
    dtype): ``L // block_size + (L % block_size >= min_ratio)`` with ``L`` the keys of rank 0's
    KV share, ``(k // (W*I)) * I + min(k % (W*I), I)`` (``k`` itself when ``kv_cp_world_size``
    ``W`` is 1). Example: plain, block 16, ``W=3, I=1``: ``[300, 17]`` -> shares ``[100, 6]``
    -> ``[7, 1]``; ratio 4, block 16, unsharded: ``[17, 20]`` -> ``[1, 2]``."""
    k = seqlen_k
    if cfg.kv_cp_world_size > 1:
        cycle, inter = cfg.kv_cp_world_size * cfg.kv_cp_interleave, cfg.kv_cp_interleave
        k = torch.div(k, cycle, rounding_mode="floor") * inter + torch.clamp(k % cycle, max=inter)
    return torch.div(k, cfg.block_size, rounding_mode="floor") + (k % cfg.block_size >= cfg.min_ratio).to(k.dtype)


def seqlen_k_covered(num_blocks: Any, cfg: MetadataConfig) -> Any:
    """The largest ``seqlen_k`` a table of ``num_blocks`` blocks covers (the inverse of
    :func:`blocks_needed`; not capped at ``max_model_len``); an int or an int64 array.

    ``nb * block_size * W + min_ratio - 1``: rank 0's ``nb * block_size`` keys reach position
    ``nb * block_size * W`` (``block_size % I == 0``, so rank 0's share of a whole number of
    ``W * I`` cycles), and a compressed config's last ``min_ratio - 1`` keys compress to nothing.
    Examples: block 128, ratio 4, 2 blocks -> 259; plain, block 16, W=3, 7 blocks -> 336
    (``blocks_needed(336) == 7``, ``blocks_needed(337) == 8``).
    """
    return num_blocks * (cfg.block_size * cfg.kv_cp_world_size) + (cfg.min_ratio - 1)
