"""The driver's common step frame written in ONE compiled call: the header, the values, the region.

The mirror of :mod:`.step_read_njit`: most frames a ``ReplicatedBatchState`` driver sends are
alike -- the step layout every follower holds (its id only), no checksum (values ``[step, check,
request ids, spec words]``). :func:`write_step_frame` writes such a frame whole
into the ring slot, byte for byte what the frame codec writes for it (``FrameWriter.write``,
``encode_body``, ``OpLog.pack_into``, ``seal``; ``tests/test_step_write.py`` holds the two to
each other), its padding zeroed; :func:`step_frame_size` gives the sizes the slot is reserved
with first. :func:`send_step_frame` does all of it and the ring's claim and publish in one call
(``transport/ring_njit``): the driver's send without the transport's Python. Any other frame
(the first, with its layout block; a checksummed one; a spec value past int64) goes through the
codec as before.

The values block is msgpack as ``msgpack.Packer`` writes it: ``0x94`` (a 4-array), the step, a
bool (``0xc2`` / ``0xc3``), the request ids' array (the codec's bytes for it, ``ids``: ``0x90``
when none), the spec words' array (``0x90 | k`` up to 15,
else ``0xdc`` and a big-endian uint16) and each word in its shortest form (positive: fixint, then
``0xcc`` .. ``0xcf``; negative: fixint from -32, then ``0xd0`` .. ``0xd3``). Worked example: step
2, False, words ``[0, 0, 1, -2, 64, 0, 0]`` -> ``94 02 c2 90 97 00 00 01 fe 40 00 00`` (12 bytes).
"""

from __future__ import annotations

import numpy as np

from ..base_njit import crc32, put_le_word
from ..broadcast.wire import CRC_AT, HEADER, META_CRC_AT
from ..jit import kernel
from ..transport.ring_njit import ring_claim, ring_publish
from .ops_njit import pack_region

__all__ = ["write_step_frame", "step_frame_size", "values_len", "send_step_frame", "S_VALUES", "S_CHANGED"]

S_VALUES, S_CHANGED = -3, -4  # send_step_frame: values over the codec's limit; the columns changed mid-write

_HEAD = HEADER.size
_FIXED = 24  # magic, version, flags, fingerprint: the caller's template


@kernel
def _int_len(v: int) -> int:
    """Bytes of msgpack's shortest encoding of the int64 ``v``."""
    if -32 <= v <= 0x7F:
        return 1
    if v > 0:
        return 2 if v <= 0xFF else 3 if v <= 0xFFFF else 5 if v <= 0xFFFFFFFF else 9
    return 2 if v >= -128 else 3 if v >= -32768 else 5 if v >= -2147483648 else 9


@kernel
def _put_int(buf: np.ndarray, at: int, v: int) -> int:
    """``v`` in msgpack's shortest encoding at ``at``; returns where the next value goes."""
    n = _int_len(v)
    if n == 1:
        buf[at] = v & 0xFF
        return at + 1
    if v > 0:
        buf[at] = 0xCC + (0 if n == 2 else 1 if n == 3 else 2 if n == 5 else 3)
    else:
        buf[at] = 0xD0 + (0 if n == 2 else 1 if n == 3 else 2 if n == 5 else 3)
    for i in range(n - 1):  # big-endian
        buf[at + 1 + i] = (v >> (8 * (n - 2 - i))) & 0xFF
    return at + n


@kernel
def values_len(step: int, words: np.ndarray, ids: np.ndarray) -> int:
    """Bytes of the values block ``[step, check, request ids, words]`` (``ids``: the ids' array
    as msgpack bytes)."""
    k = words.shape[0]
    n = 1 + _int_len(step) + 1 + ids.shape[0] + (1 if k <= 15 else 3)
    for i in range(k):
        n += _int_len(words[i])
    return n


@kernel
def step_frame_size(flat: np.ndarray, off: np.ndarray, n: np.ndarray, digest: np.ndarray, widths: np.ndarray,
                    dims: np.ndarray, starts: np.ndarray, step: int, words: np.ndarray, ids: np.ndarray
                    ) -> tuple[int, int]:
    """``(values in the region, values block bytes)`` of the step frame of the op log's columns
    (``OpLog.buffers``) and ``digest``; writes the frame's ``dims`` and the columns' ``starts``."""
    got = pack_region(flat, off, n, digest, widths, flat[:0], dims, starts)
    return (-got if got < 0 else got), values_len(step, words, ids)


@kernel
def write_step_frame(frame: np.ndarray, region: np.ndarray, fixed: np.ndarray, lid: int, frame_step: int,
                     step: int, check: bool, ids: np.ndarray, words: np.ndarray, dims: np.ndarray, flat: np.ndarray,
                     off: np.ndarray, n: np.ndarray, digest: np.ndarray, widths: np.ndarray,
                     starts: np.ndarray) -> int:
    """The whole frame into ``frame`` (uint8, the slot reserved for exactly it): header (the
    first 24 bytes ``fixed``, layout id ``lid``, frame number ``frame_step``), the values
    ``[step, check, request ids, words]`` (``ids``: the ids' array as the codec's msgpack), the dims, the region (``region``: an int64 view of ``frame``
    where the region starts, as long as its values), the padding zeroed, the meta crc last.
    Returns the region's values written (``len(region)``, else the columns changed since
    :func:`step_frame_size`: ``-need``, the frame unsealed)."""
    total = pack_region(flat, off, n, digest, widths, region, dims, starts)
    if total != region.shape[0]:
        return -abs(total)
    n_dims = dims.shape[0]
    vlen = values_len(step, words, ids)
    shapes_at = (_HEAD + vlen + 7) // 8 * 8
    data_at = (shapes_at + 8 * n_dims + 15) // 16 * 16
    frame[:_FIXED] = fixed
    put_le_word(frame, 24, lid, 4)
    frame[CRC_AT:48] = 0  # frame crc, layout block length, values length, dims, meta crc (below)
    put_le_word(frame, 36, vlen, 4)
    put_le_word(frame, 40, n_dims, 4)
    put_le_word(frame, 48, 8 * total, 8)
    put_le_word(frame, 56, frame_step, 8)
    frame[_HEAD] = 0x94
    at = _put_int(frame, _HEAD + 1, step)
    frame[at] = 0xC3 if check else 0xC2
    at += 1
    frame[at:at + ids.shape[0]] = ids
    at += ids.shape[0]
    k = words.shape[0]
    if k <= 15:
        frame[at] = 0x90 | k
        at += 1
    else:
        frame[at] = 0xDC
        frame[at + 1] = k >> 8
        frame[at + 2] = k & 0xFF
        at += 3
    for i in range(k):
        at = _put_int(frame, at, words[i])
    frame[at:shapes_at] = 0
    for i in range(n_dims):
        put_le_word(frame, shapes_at + 8 * i, dims[i], 8)
    frame[shapes_at + 8 * n_dims:data_at] = 0
    frame[data_at + 8 * total:] = 0  # the region's padding to 16
    c = crc32(frame, 0, CRC_AT, 0)
    c = crc32(frame, CRC_AT + 4, META_CRC_AT, c)
    put_le_word(frame, META_CRC_AT, crc32(frame, META_CRC_AT + 4, data_at, c), 4)
    return total


@kernel
def send_step_frame(m32: np.ndarray, m64: np.ndarray, m8: np.ndarray, readers: int, num_slots: int,
                    slot_size: int, ring_data_at: int, floor: int, fixed: np.ndarray, lid: int, frame_step: int,
                    step: int, check: bool, ids: np.ndarray, words: np.ndarray, flat: np.ndarray, off: np.ndarray,
                    n: np.ndarray, dims: np.ndarray, starts: np.ndarray, digest: np.ndarray, widths: np.ndarray,
                    max_values: int) -> int:
    """The common step frame (:func:`write_step_frame`'s arguments) claimed, written and
    published in a shared-memory ring (``ShmRing.direct``'s words, then ``m8`` / ``m64``: the
    mapping as bytes / uint64): 1 when a parked reader must be woken, 0 when none, ``S_VALUES``
    (nothing written) when the values block is over ``max_values`` bytes, ``S_CHANGED`` (nothing
    published) as :func:`write_step_frame`'s refusal, the ring's
    ``CLAIM_CLOSED`` / ``CLAIM_SLOW`` (nothing published) when the Python path must send it."""
    total, vlen = step_frame_size(flat, off, n, digest, widths, dims, starts, step, words, ids)
    if vlen > max_values:
        return S_VALUES
    shapes_at = (_HEAD + vlen + 7) // 8 * 8
    data_at = (shapes_at + 8 * dims.shape[0] + 15) // 16 * 16
    nbytes = data_at + (8 * total + 15) // 16 * 16
    pos, head = ring_claim(m32, m64, readers, num_slots, slot_size, ring_data_at, nbytes, floor)
    if pos < 0:
        return pos
    region = m64[(pos + data_at) // 8:(pos + data_at) // 8 + total].view(np.int64)
    if write_step_frame(m8[pos:pos + nbytes], region, fixed, lid, frame_step, step, check, ids, words, dims, flat,
                        off, n, digest, widths, starts) != total:
        return S_CHANGED  # (claimed, never published: the next claim takes the same slots)
    return 1 if ring_publish(m32, m64, readers, head) else 0
