"""Rank side of the live-ring fuzz in ``tests/test_fuzz_inputs.py`` (3 gloo ranks).

Rank 0 (the driver) captures the frames of ``CAPTURE_STEPS`` real broadcasts, then writes
``N_CRAFTED`` hand-made hostile frames (:func:`_crafted`) and ``MUTATED_FRAMES`` random mutations
(:func:`_mutate`) straight into its ring end, each followed by a valid broadcast; the followers
classify what ``broadcast(None)`` does with every hostile frame (:func:`_receive_hostile`) and
verify the valid one after it. Last, rank 2 runs with a skewed protocol version / schema
(:func:`_skew_phase`). Frame layout (``ObjectChannel.broadcast_packed``)::

    | header length u64 | codec header [msg, descs] | zeros to 16 | packed tensor bytes |
"""

from __future__ import annotations

import random
import struct
from typing import Any

import torch

from reliability_cases import make_payload, verify_payload
from transport import decode, encode

__all__ = ["RING_ENV", "RING_BYTES", "CAPTURE_STEPS", "MUTATED_FRAMES", "N_CRAFTED",
           "wire_rank", "FRAME_LEN"]

RING_ENV = {"CPMETA_SHM_SLOT_SIZE": "4096", "CPMETA_SHM_NUM_SLOTS": "16"}
RING_BYTES = 4096 * 16
CAPTURE_STEPS = 24  # valid broadcasts whose frames are captured (rank 0) for the decode fuzz
MUTATED_FRAMES = 160  # random mutations written through the ring
N_CRAFTED = 14  # hand-made hostile frames (see _crafted)
KEEP_FRAME_BYTES = 32 * 1024  # frames returned to the parent (the header fuzz needs few bytes)
FRAME_LEN = struct.Struct("<Q")  # header-length prefix of a packed frame
_LEN = FRAME_LEN


def _capture(ring: Any, store: list) -> None:
    """Record every frame the driver's ring end writes (joined bytes)."""
    write = ring.write

    def recording(parts: Any, **kw: Any) -> None:
        raw = parts if isinstance(parts, (list, tuple)) else [parts]
        store.append(b"".join(bytes(memoryview(p).cast("B")) for p in raw))
        write(parts, **kw)

    ring.write = recording


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    """A random corruption, biased to the length prefix and the codec header of the frame."""
    b = bytearray(frame)
    (hlen,) = _LEN.unpack_from(b, 0)
    head_end = min(len(b), _LEN.size + hlen)
    op = rng.randrange(6)
    if op == 0:  # flip bytes inside the codec header
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(head_end)] = rng.randrange(256)
    elif op == 1:  # flip bytes anywhere
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2:  # truncate
        del b[rng.randrange(len(b)):]
    elif op == 3:  # a different length prefix (small, off by a little, or huge)
        _LEN.pack_into(b, 0, rng.choice([0, 1, hlen - 1, hlen + 1, len(b), 2**63, 2**64 - 1]))
    elif op == 4:  # insert junk inside the header
        at = rng.randrange(_LEN.size, head_end + 1)
        b[at:at] = rng.randbytes(rng.randint(1, 16))
    else:  # header of one frame, payload of a shorter/longer one
        b.extend(rng.randbytes(rng.randint(1, 64)))
    return bytes(b)


def _crafted(frame: bytes, schema: bytes) -> list[tuple[str, bytes]]:
    """Hand-made hostile frames derived from one valid frame (see the module docstring)."""
    from cpmeta.broadcast import MESSAGE_VERSION
    from transport import TensorDesc

    (hlen,) = _LEN.unpack_from(frame, 0)
    msg, descs = decode(frame[_LEN.size:_LEN.size + hlen], schema=schema)
    payload = frame[_align16(_LEN.size + hlen):]  # tensors start 16-byte aligned after the header

    def frame_of(m: Any, d: Any, body: bytes = payload, sch: bytes = schema) -> bytes:
        head = _LEN.pack(len(encode([m, d], schema=sch))) + encode([m, d], schema=sch)
        return head + bytes(_align16(len(head)) - len(head)) + body

    def with_(**kw: Any) -> dict:
        return {**msg, **kw}

    n = len(msg["dtypes"])
    out = [
        ("payload of 1 TiB declared", frame_of(msg, [TensorDesc(torch.uint8, (1 << 40,))])),
        ("shapes far beyond the buffer", frame_of(with_(shapes=[s * (1 << 20) + 1 for s in msg["shapes"]]), descs)),
        ("negative offsets", frame_of(with_(offsets=[-4096] * n), descs)),
        ("offsets past the buffer", frame_of(with_(offsets=[1 << 40] * n), descs)),
        ("unknown dtype code", frame_of(with_(dtypes=[99] * n), descs)),
        ("unknown field path", frame_of(with_(paths=";".join(["__class__"] * n)), descs)),
        ("values not a dict", frame_of(with_(values=[1, 2]), descs)),
        ("value and dict entries on one field", frame_of(with_(values={**msg["values"], "klen": 3, "klen.4": 1}), descs)),
        ("message is a list", frame_of([1, 2, 3], descs)),
        ("layout lists of different lengths", frame_of(with_(ndims=msg["ndims"] + [1]), descs)),
        ("message version skew", frame_of(with_(version=MESSAGE_VERSION + 1), descs)),
        ("schema field skew", frame_of(with_(schema="0" * 16), descs)),
        ("codec schema skew", frame_of(msg, descs, sch=b"\xff" * len(schema))),
    ]
    bad_version = bytearray(frame)
    bad_version[_LEN.size + 4] += 1  # codec header: protocol version byte
    out.append(("codec protocol version skew", bytes(bad_version)))
    return out


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def _guard_collective(bc: Any) -> None:
    """A corrupted ``packed`` flag would send the follower into a gloo collective the driver
    never enters (it would wait for the process-group timeout): make that an error here."""
    def refuse() -> Any:
        raise _CollectiveEntered("follower would enter the tensor collective")

    bc._tensor_channel = refuse


class _CollectiveEntered(RuntimeError):
    pass


def wire_rank(rank: int, world: int, seed: int) -> dict:
    import cpmeta
    from cpmeta.broadcast import SCHEMA_FINGERPRINT

    rng = random.Random(seed)
    out: dict = {"frames": [], "names": [], "hostile": [], "recovered": 0, "skew": {}}
    step = 0

    def valid() -> None:
        nonlocal step
        got = bc.broadcast(make_payload(seed, step, RING_BYTES) if rank == 0 else None)
        verify_payload(got, step)
        step += 1

    with cpmeta.MetadataBroadcaster(src=0, timeout=30.0) as bc:
        ring = bc._objects.ring
        captured: list[bytes] = []
        if rank == 0:
            _capture(ring, captured)
        else:
            _guard_collective(bc)
        for _ in range(CAPTURE_STEPS):
            valid()
        if rank == 0:
            del ring.write  # the instance patch: back to ShmRing.write
            out["frames"] = [f for f in captured if len(f) <= KEEP_FRAME_BYTES]
            hostile = _crafted(out["frames"][0], SCHEMA_FINGERPRINT.encode())
            assert len(hostile) == N_CRAFTED
            hostile += [("mutated", _mutate(rng.choice(captured), rng)) for _ in range(MUTATED_FRAMES)]
            out["names"] = [name for name, _ in hostile]
        for i in range(N_CRAFTED + MUTATED_FRAMES):
            if rank == 0:
                ring.write(hostile[i][1])
            else:
                out["hostile"].append(_receive_hostile(bc, rank))
            valid()  # the ring stays in step: the next real message arrives intact
            out["recovered"] += 1
        _skew_phase(bc, rank, seed, out, valid)
    return out


def _receive_hostile(bc: Any, rank: int) -> tuple[str, bool, str]:
    """(outcome, error names this rank, message) of one hostile frame on a follower."""
    try:
        bc.broadcast(None)
    except Exception as e:  # noqa: BLE001 - classified by the parent
        return type(e).__name__, f"rank {rank}" in str(e), str(e)[:200]
    return "accepted", False, ""


def _skew_phase(bc: Any, rank: int, seed: int, out: dict, valid: Any) -> None:
    """Rank 2 runs with another protocol version / schema; rank 1 must be unaffected."""
    import cpmeta.broadcast.broadcaster as cb
    import transport.codec as codec

    patches = [
        ("protocol version", codec, "PROTOCOL_VERSION", codec.PROTOCOL_VERSION + 1),
        ("codec schema", bc._objects, "schema", b"\x00" * 16),
        ("message version", cb, "MESSAGE_VERSION", cb.MESSAGE_VERSION + 1),
        ("schema fingerprint", cb, "SCHEMA_FINGERPRINT", "f" * 16),
    ]
    for what, obj, attr, value in patches:
        old = getattr(obj, attr)
        if rank == 2:
            setattr(obj, attr, value)
        try:
            valid()
            out["skew"][what] = "accepted"
        except RuntimeError as e:
            out["skew"][what] = str(e)
            # the skewed rank skipped that message; everyone else consumed it
        finally:
            setattr(obj, attr, old)
