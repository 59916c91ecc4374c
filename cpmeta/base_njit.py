"""Kernels every room's kernels share (the lowest kernel module: config-level rules, the error
report), so no two rooms keep a copy of the same formula.

Worked example: ``blocks_needed_one(300, 128, 4, 1, 1)`` -> ``2 + (44 >= 4) = 3`` (the rule of
:func:`cpmeta.config.blocks_needed`); ``fail(err, 3, 1, -2, 0)`` leaves ``err = [3, 1, -2, 0]``
and returns 3.
"""

from __future__ import annotations

import numpy as np

from .constants import INT32_MAX
from .jit import kernel, warmer

__all__ = ["fail", "blocks_needed_one", "copy_from0", "copy_ids", "crc32", "le_word", "put_le_word"]


def _crc_table() -> np.ndarray:
    """CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320: zlib's) of every byte value."""
    t = np.zeros(256, np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (0xEDB88320 ^ (c >> 1)) if c & 1 else c >> 1
        t[i] = c
    return t


_CRC_TABLE = _crc_table()


@kernel
def fail(err: np.ndarray, code: int, index: int, value: int, limit: int) -> int:
    """Write ``[code, index, value, limit]`` into ``err`` and return ``code``."""
    err[0] = code
    err[1] = index
    err[2] = value
    err[3] = limit
    return code


@kernel
def copy_from0(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:len(src)] = src`` as a loop indexed from 0: it vectorizes, where a slice
    assignment checks for overlap and an index offset by a variable keeps numba's negative-index
    test on every element (~3x slower on a 4096-token prompt)."""
    for j in range(src.shape[0]):
        dst[j] = src[j]


@kernel
def copy_ids(dst: np.ndarray, src: np.ndarray) -> bool:
    """:func:`copy_from0` of token ids; True when one lies outside ``[0, 2**31 - 1]`` (one test
    per id without a branch)."""
    bad = False
    for j in range(src.shape[0]):
        v = src[j]
        dst[j] = v
        bad |= (v < 0) | (v > INT32_MAX)
    return bad


@kernel
def blocks_needed_one(sk: int, block_size: int, min_ratio: int, kv_cycle: int, kv_inter: int) -> int:
    """``blocks_needed(seqlen_k)`` of :mod:`cpmeta.config` for one sequence: rank 0's share
    ``L = (k // cycle) * inter + min(k % cycle, inter)`` (``cycle = kv_cp_world_size *
    kv_cp_interleave``, ``inter = kv_cp_interleave``; world 1 gives ``L = k``), then
    ``L // block_size + (L % block_size >= min_ratio)``. Example: block 128, min ratio 4, k = 300
    -> ``2 + (44 >= 4) = 3``."""
    L = sk
    if kv_cycle > 1:  # KV sharded over a CP group (two divisions saved per sequence without it)
        r = sk % kv_cycle
        L = (sk // kv_cycle) * kv_inter + (r if r < kv_inter else kv_inter)
    return L // block_size + (1 if L % block_size >= min_ratio else 0)


@kernel
def crc32(buf: np.ndarray, lo: int, hi: int, crc: int) -> int:
    """``zlib.crc32(buf[lo:hi], crc)`` of a uint8 array, a byte at a time (for the few hundred
    bytes of a frame's head). Example: ``crc32(b"abc" as uint8, 0, 3, 0)`` = ``0x352441c2``."""
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    for i in range(lo, hi):
        c = _CRC_TABLE[(c ^ buf[i]) & 0xFF] ^ (c >> np.uint32(8))
    return np.int64(c ^ np.uint32(0xFFFFFFFF))


@kernel
def le_word(buf: np.ndarray, at: int, n: int) -> int:
    """The little-endian unsigned ``n``-byte word of a uint8 array at ``at`` (``n`` <= 8; a word
    of 8 bytes with its top bit set comes out negative)."""
    v = np.int64(0)
    for k in range(n):
        v |= np.int64(buf[at + k]) << (8 * k)
    return v


@kernel
def put_le_word(buf: np.ndarray, at: int, v: int, n: int) -> None:
    """:func:`le_word`'s inverse: ``v``'s low ``n`` bytes (``n`` <= 8) little-endian at ``at``."""
    for k in range(n):
        buf[at + k] = (v >> (8 * k)) & 0xFF


@warmer
def _warm() -> None:
    """Each kernel once."""
    fail(np.zeros(4, np.int64), 0, 0, 0, 0)
    blocks_needed_one(5, 4, 1, 1, 1)
    a = np.zeros(2, np.int64)
    copy_from0(a, a[:1])
    copy_ids(a, a[:1])
    b = np.zeros(8, np.uint8)
    crc32(b, 0, 8, 0)
    le_word(b, 0, 8)
    put_le_word(b, 0, 1, 8)
