"""``MetadataConfig``: the model/cache constants every builder reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .constants import INT32_MAX

__all__ = ["MetadataConfig", "YOCO_MODES"]

YOCO_MODES = ("mask", "compact")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ratio_tuple(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a tuple of positive ints, got {value!r}")
    out = tuple(value)
    for r in out:
        if not _is_int(r) or not 1 <= r <= INT32_MAX:
            raise ValueError(f"{name}: expected ints in [1, 2**31 - 1], got {r!r} in {out!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: ratio listed twice in {out!r}")
    return out


@dataclass(frozen=True, slots=True)
class MetadataConfig:
    """Model and cache constants for one engine (validated on construction).

    ``ca_ratios`` is the sorted union of dense and sparse compression ratios; every ratio must
    divide ``block_size``. Dict-valued metadata fields are keyed by ``str(ratio)``.

    Example: ``MetadataConfig(block_size=128, dense_compress_ratios=(4, 128),
    sparse_compress_ratios=(4,))`` has ``ca_ratios == (4, 128)`` and ``min_ratio == 4``.
    """

    block_size: int = 128  # paged KV block size, in tokens of the uncompressed sequence
    window_size: int = 128  # W: sliding-window length
    swa_block_size: int = 128  # S: SWA ring length per state slot, S >= W
    dense_compress_ratios: tuple[int, ...] = (4,)  # ratios n of core-attention compressed KV
    sparse_compress_ratios: tuple[int, ...] = (4,)  # ratios r of top-k sparse compressed KV
    max_model_len: int = 8192  # max tokens per sequence
    max_ngram_size: int = 0  # Engram look-back width (0 = off)
    ngram_pad_token: int = 0  # pad id written into ngram_token_ids
    ngram_lookup: Optional[torch.Tensor] = field(default=None, compare=False)  # [vocab] int
    image_token_id: Optional[int] = None  # image sentinel id
    force_load_balance: bool = False  # value of gate_force_random
    yoco_keep_tokens: Optional[int] = None  # YoCo: consumer layers keep the last k tokens
    yoco_mode: str = "compact"  # "mask" or "compact"
    # derived constants, computed once in __post_init__ (the builders read them every step; a
    # property recomputing them cost ~2-4 us per read)
    _ca: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _max_num_blocks: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("block_size", "window_size", "swa_block_size", "max_model_len"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= INT32_MAX:
                raise ValueError(f"{name}: expected an int in [1, 2**31 - 1], got {v!r}")
        if self.swa_block_size < self.window_size:
            raise ValueError(
                f"swa_block_size: expected >= window_size ({self.window_size}), "
                f"got {self.swa_block_size}"
            )
        dense = _ratio_tuple("dense_compress_ratios", self.dense_compress_ratios)
        sparse = _ratio_tuple("sparse_compress_ratios", self.sparse_compress_ratios)
        object.__setattr__(self, "dense_compress_ratios", dense)
        object.__setattr__(self, "sparse_compress_ratios", sparse)
        if not dense and not sparse:
            raise ValueError("dense_compress_ratios/sparse_compress_ratios: ca_ratios is empty")
        ca = tuple(sorted(set(dense) | set(sparse)))
        object.__setattr__(self, "_ca", ca)
        m = ca[0]
        object.__setattr__(self, "_max_num_blocks", -(-(self.max_model_len // m) // (self.block_size // m)))
        for n in self.ca_ratios:
            if self.block_size % n:
                which = "dense_compress_ratios" if n in dense else "sparse_compress_ratios"
                raise ValueError(f"{which}: ratio {n} does not divide block_size {self.block_size}")
        if not _is_int(self.max_ngram_size) or not 0 <= self.max_ngram_size <= INT32_MAX:
            raise ValueError(f"max_ngram_size: expected an int >= 0, got {self.max_ngram_size!r}")
        if not _is_int(self.ngram_pad_token) or abs(self.ngram_pad_token) > INT32_MAX:
            raise ValueError(f"ngram_pad_token: expected an int32 value, got {self.ngram_pad_token!r}")
        if self.ngram_lookup is not None:
            t = self.ngram_lookup
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point:
                raise ValueError("ngram_lookup: expected a 1-D integer tensor or None")
        if self.image_token_id is not None and (
            not _is_int(self.image_token_id) or abs(self.image_token_id) > INT32_MAX
        ):
            raise ValueError(f"image_token_id: expected an int or None, got {self.image_token_id!r}")
        if not isinstance(self.force_load_balance, bool):
            raise ValueError(f"force_load_balance: expected a bool, got {self.force_load_balance!r}")
        k = self.yoco_keep_tokens
        if k is not None and (not _is_int(k) or k < 1):
            raise ValueError(f"yoco_keep_tokens: expected an int >= 1 or None, got {k!r}")
        if self.yoco_mode not in YOCO_MODES:
            raise ValueError(f"yoco_mode: expected one of {YOCO_MODES}, got {self.yoco_mode!r}")

    @property
    def ca_ratios(self) -> tuple[int, ...]:
        """Sorted union of dense and sparse ratios."""
        return self._ca

    @property
    def min_ratio(self) -> int:
        return self._ca[0]

    @property
    def max_num_blocks(self) -> int:
        """Columns of decode ``block_tables``: ``cdiv(max_model_len // m, block_size // m)``."""
        return self._max_num_blocks

    def attn_index_width(self, n: int) -> int:
        """Width of ``kv_ca_index[str(n)]``: ``cdiv(max_model_len // n, 128) * 128``."""
        from .constants import ATTN_INDEX_ALIGN

        return -(-(self.max_model_len // n) // ATTN_INDEX_ALIGN) * ATTN_INDEX_ALIGN
