"""The broadcast frame as the tests see it, and the rank side of the live-ring fuzz.

Frame reference (an independent re-implementation of ``cpmeta.broadcast.wire``'s v7 format):
:func:`parts` reads the header words and block offsets, :func:`reseal` recomputes the meta crc
(and the frame crc) the way a writer that knows the format would, :func:`build` assembles a sealed
frame; :func:`loopback` builds REAL broadcasters on an in-process loopback channel
(``tests/test_wire_fuzz.py``, ``tests/test_security.py``).

Live-ring fuzz of ``tests/test_fuzz_inputs.py`` (3 gloo ranks):

Rank 0 (the driver) captures the frames of ``CAPTURE_STEPS`` real broadcasts, then writes
``N_CRAFTED`` hand-made hostile frames (:func:`_crafted`) and ``MUTATED_FRAMES`` random mutations
(:func:`_mutate`) straight into its ring end, each followed by a valid broadcast; the followers
classify what ``broadcast(None)`` does with every hostile frame (:func:`_receive_hostile`) and
verify the valid one after it. Last, rank 2 runs with a skewed protocol version / schema
(:func:`_skew_phase`). Frame layout (``cpmeta.broadcast.wire``)::

    | header (64 B: magic, version, flags, schema, layout id, crc, block lengths, meta crc,
    | exact tensor bytes, step) | layout? | values | shapes (int64) | packed tensor bytes (16-aligned) |
"""

from __future__ import annotations

import contextlib
import random
import struct
import zlib
from typing import Any, Iterator

import torch

from reliability_cases import make_payload, verify_payload
from cpmeta.transport import decode_body, encode_body

__all__ = ["RING_ENV", "RING_BYTES", "CAPTURE_STEPS", "MUTATED_FRAMES", "N_CRAFTED",
           "wire_rank", "FRAME_LEN", "HEADER", "AT", "FMT", "FLAG_LAYOUT", "FLAG_CRC",
           "FLAG_PACKED", "parts", "reseal", "build", "loopback", "receive", "restep"]

RING_ENV = {"CPMETA_SHM_SLOT_SIZE": "4096", "CPMETA_SHM_NUM_SLOTS": "16"}
RING_BYTES = 4096 * 16
CAPTURE_STEPS = 24  # valid broadcasts whose frames are captured (rank 0) for the decode fuzz
MUTATED_FRAMES = 160  # random mutations written through the ring
N_CRAFTED = 14  # hand-made hostile frames (see _crafted)
KEEP_FRAME_BYTES = 32 * 1024  # frames returned to the parent (the header fuzz needs few bytes)
FRAME_HEADER = struct.Struct("<4sHH16sIIIIIIQQ")  # cpmeta.broadcast.wire.HEADER
FRAME_LEN = FRAME_HEADER  # (old name, kept for importers)


HEADER = struct.Struct("<4sHH16sIIIIIIQQ")  # magic ver flags schema lid crc llen vlen n_dims meta tbytes step
AT = {"flags": 6, "lid": 24, "crc": 28, "llen": 32, "vlen": 36, "n_dims": 40, "meta": 44, "tbytes": 48,
      "step": 56}
FMT = {"flags": "<H", "tbytes": "<Q", "step": "<Q"}
FLAG_LAYOUT, FLAG_CRC, FLAG_PACKED = 1, 2, 4
U32 = struct.Struct("<I")


# ----------------------------------------------------------------------------- frame reference

def parts(frame: bytes) -> dict:
    """Header words and block offsets of a v7 frame (docs in cpmeta/broadcast/wire.py)."""
    (_, _, flags, _, lid, _, llen, vlen, n_dims, _, tbytes, step) = HEADER.unpack_from(frame, 0)
    shapes_at = _align(HEADER.size + llen + vlen, 8)
    data_at = _align(shapes_at + 8 * n_dims, 16)
    return {"flags": flags, "lid": lid, "llen": llen, "vlen": vlen, "n_dims": n_dims,
            "tbytes": tbytes, "step": step, "shapes_at": shapes_at, "data_at": data_at,
            "dims": list(struct.unpack_from(f"<{n_dims}q", frame, shapes_at))}


def reseal(frame: bytes | bytearray, full: bool = True) -> bytes:
    """What a writer that knows the format does: recompute the meta crc (bytes before the
    tensors, both crc words left out) and, with ``full`` and FLAG_CRC set, the frame crc."""
    b = bytearray(frame)
    if len(b) < HEADER.size:
        return bytes(b)
    (_, _, flags, _, _, _, llen, vlen, n_dims, _, _, _) = HEADER.unpack_from(b, 0)
    end = min(_align(_align(HEADER.size + llen + vlen, 8) + 8 * n_dims, 16), len(b))
    meta = zlib.crc32(bytes(b[48:end]), zlib.crc32(bytes(b[32:44]), zlib.crc32(bytes(b[:28]))))
    U32.pack_into(b, AT["meta"], meta)
    if full and flags & FLAG_CRC:
        U32.pack_into(b, AT["crc"], zlib.crc32(bytes(b[32:]), zlib.crc32(bytes(b[:28]))))
    return bytes(b)


def build(layout: list, values: list, dims: list[int], data: bytes, flags: int, *,
          tbytes: int, lid: int | None = None, step: int = 1, fingerprint: bytes | None = None) -> bytes:
    """A sealed v7 frame from its parts (the layout id = crc32 of the encoded block; the schema
    fingerprint ``InputMetadata``'s unless given)."""
    from cpmeta.broadcast import SCHEMA_FINGERPRINT
    from cpmeta.broadcast.wire import MESSAGE_VERSION
    from cpmeta.transport import encode_body

    lblock = encode_body(layout) if flags & FLAG_LAYOUT else b""
    vblock = encode_body(values)
    lid = zlib.crc32(lblock) if lid is None else lid
    head = HEADER.pack(b"CPMB", MESSAGE_VERSION, flags, fingerprint or SCHEMA_FINGERPRINT.encode(), lid, 0,
                       len(lblock), len(vblock), len(dims), 0, tbytes, step)
    out = bytearray(head + lblock + vblock)
    out += bytes(_align(len(out), 8) - len(out)) + struct.pack(f"<{len(dims)}q", *dims)
    out += bytes(_align(len(out), 16) - len(out))
    return reseal(bytes(out) + data)


# ----------------------------------------------------------------------------- loopback ranks

class _Loop:
    """Stands in for ObjectChannel: the driver's frames are kept, the follower reads ``inbox``."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.frames: list[bytes] = []
        self.inbox = b""
        self.timeout, self.ctrl, self.ring = 30.0, None, None
        self.has_readers = True  # the test reads every frame the driver sends

    @property
    def frames_out(self) -> int:  # as ObjectChannel's: the frames handed out whole
        return len(self.frames)

    def send_frame(self, nbytes: int, fill: Any) -> None:
        from cpmeta.transport.coalesce import tensor_memoryview

        t = torch.zeros(nbytes, dtype=torch.uint8)
        fill(tensor_memoryview(t), t.data_ptr())
        self.frames.append(bytes(tensor_memoryview(t)))

    def recv_frame(self, consumer: Any) -> Any:
        return consumer(memoryview(bytearray(self.inbox)))

    def announce(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Collective:
    """Stands in for TensorChannel: the driver's buffer is kept; a follower's buffer of the same
    size receives it (a size mismatch is an error: both sides size it from the frame)."""

    last: torch.Tensor = torch.empty(0, dtype=torch.uint8)

    def __init__(self, receiving: bool) -> None:
        self.receiving = receiving

    def broadcast_buffer(self, buf: torch.Tensor) -> None:
        if not self.receiving:
            _Collective.last = buf.clone()
            return
        if buf.numel() != _Collective.last.numel():
            raise RuntimeError("collective: the follower expects another region than the driver sent")
        buf.copy_(_Collective.last)


@contextlib.contextmanager
def loopback() -> Iterator[Any]:
    """``make(rank, checksum, persistent=False, **kw)`` -> a real MetadataBroadcaster on a
    :class:`_Loop` (2-rank group; ``persistent`` = ``persistent_outputs``; ``kw`` its other
    arguments, e.g. ``schema=`` or ``tensor_path="collective"``: the tensors of a collective
    frame are then handed over in process, :class:`_Collective`)."""
    from unittest import mock

    import torch.distributed as dist
    import cpmeta.transport as transport
    from cpmeta import MetadataBroadcaster

    rank = [0]
    group = mock.NonCallableMock(spec=dist.ProcessGroup)  # (a constructor's group check takes it for one)

    def make(r: int, checksum: bool, persistent: bool = False, **kw: Any) -> Any:
        rank[0] = r
        if persistent:
            kw["persistent_outputs"] = True
        bc = MetadataBroadcaster(group=group, src=0, checksum=checksum, **kw)
        if kw.get("tensor_path") == "collective":
            bc._tensors = _Collective(receiving=r != 0)
        return bc

    with mock.patch.object(dist, "get_rank", lambda *a: rank[0]), \
            mock.patch.object(dist, "get_backend", lambda *a: "gloo"), \
            mock.patch.object(dist, "get_process_group_ranks", lambda *a: [0, 1]), \
            mock.patch.object(transport, "ObjectChannel", _Loop):
        yield make


def receive(fol: Any, frame: bytes, step: int | None = None) -> Any:
    """``fol.broadcast(None)`` of ``frame``, the follower expecting step ``step`` (default: the
    one ``frame`` carries): the tests replay frames, which a follower otherwise refuses."""
    if step is None:
        step = parts(frame)["step"] if len(frame) >= HEADER.size else 1
    fol._ch.reader.step = step - 1
    fol._objects.inbox = frame
    return fol.broadcast(None)


def restep(frame: bytes, step: int) -> bytes:
    """``frame`` carrying step ``step``, its meta crc recomputed (as a writer that knows the
    format would; the frame crc left as it was)."""
    b = bytearray(frame)
    struct.pack_into("<Q", b, AT["step"], step)
    return reseal(bytes(b), full=False)


# ----------------------------------------------------------------------------- live-ring fuzz

def _capture(ring: Any, store: list) -> None:
    """Record every frame the driver's ring end publishes (``reserve``/``commit`` or ``write``)."""
    import ctypes

    reserve, commit, write = ring.reserve, ring.commit, ring.write
    spot: list = []

    def reserving(length: int, **kw: Any) -> Any:
        view, addr = reserve(length, **kw)
        spot[:] = [addr, length]
        return view, addr

    def committing() -> None:
        store.append(ctypes.string_at(*spot))
        commit()

    def writing(parts: Any, **kw: Any) -> None:
        raw = parts if isinstance(parts, (list, tuple)) else [parts]
        data = b"".join(bytes(memoryview(p).cast("B")) for p in raw)
        if not ring.fits(len(data)):
            store.append(data)
        write(parts, **kw)

    ring.reserve, ring.commit, ring.write = reserving, committing, writing


def _uncapture(ring: Any) -> None:
    for name in ("reserve", "commit", "write"):
        delattr(ring, name)  # the instance patches: back to ShmRing's methods


def _blocks(frame: bytes) -> dict:
    f = FRAME_HEADER.unpack(frame[:FRAME_HEADER.size])
    keys = ("magic", "version", "flags", "schema", "lid", "crc", "llen", "vlen", "ndims", "pad",
            "tbytes", "step")
    h = dict(zip(keys, f))
    at = FRAME_HEADER.size
    h["layout"] = frame[at:at + h["llen"]]
    h["values"] = frame[at + h["llen"]:at + h["llen"] + h["vlen"]]
    shapes_at = _align(at + h["llen"] + h["vlen"], 8)
    h["dims"] = list(struct.unpack_from(f"<{h['ndims']}q", frame, shapes_at))
    h["data"] = frame[_align(shapes_at + 8 * h["ndims"], 16):]
    return h


def _frame(h: dict, **kw: Any) -> bytes:
    """Re-assemble a frame from (changed) blocks; ``crc`` is left as given."""
    import zlib

    h = {**h, **kw}
    layout, values = h["layout"], h["values"]
    if "layout_obj" in kw:
        layout = encode_body(kw["layout_obj"])
        h["lid"] = zlib.crc32(layout) if "lid" not in kw else h["lid"]
        h["flags"] |= 1
    if "values_obj" in kw:
        values = encode_body(kw["values_obj"])
    head = FRAME_HEADER.pack(h["magic"], h["version"], h["flags"], h["schema"], h["lid"], h["crc"],
                             len(layout), len(values), len(h["dims"]), 0, h["tbytes"], h["step"])
    out = bytearray(head + layout + values)
    out += bytes(_align(len(out), 8) - len(out))
    out += struct.pack(f"<{len(h['dims'])}q", *h["dims"])
    out += bytes(_align(len(out), 16) - len(out))
    return reseal(bytes(out + h["data"]), full=False)  # meta crc right: the deeper checks refuse


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    """A random corruption, biased to the header and the layout / values blocks of the frame."""
    b = bytearray(frame)
    h = _blocks(frame)
    head_end = min(len(b), FRAME_HEADER.size + h["llen"] + h["vlen"])
    op = rng.randrange(6)
    if op == 0:  # flip bytes inside the header and the msgpack blocks
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(head_end)] = rng.randrange(256)
    elif op == 1:  # flip bytes anywhere
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2:  # truncate
        del b[rng.randrange(len(b)):]
    elif op == 3:  # a different block length or tensor byte count (small, off by one, huge)
        at = rng.choice([32, 36, 40, 48])
        fmt = "<Q" if at == 48 else "<I"
        (old,) = struct.unpack_from(fmt, b, at)
        new = rng.choice([0, 1, old - 1, old + 1, len(b), 2**31, 2**32 - 1])
        struct.pack_into(fmt, b, at, new % (2**64 if at == 48 else 2**32))
    elif op == 4:  # insert junk inside the header or the blocks
        at = rng.randrange(0, head_end + 1)
        b[at:at] = rng.randbytes(rng.randint(1, 16))
    else:  # header of one frame, payload of a shorter/longer one
        b.extend(rng.randbytes(rng.randint(1, 64)))
    return bytes(b)


def _crafted(frame: bytes, schema: bytes) -> list[tuple[str, bytes]]:
    """Hand-made hostile frames derived from one valid frame (one that defines its layout)."""
    from cpmeta.broadcast.wire import MESSAGE_VERSION

    h = _blocks(frame)
    lay = decode_body(h["layout"])
    vals = decode_body(h["values"])
    n = len(lay[1])
    out = [
        ("payload of 1 TiB declared", _frame(h, tbytes=1 << 40)),
        ("shapes far beyond the buffer", _frame(h, dims=[d * (1 << 20) + 1 for d in h["dims"]])),
        ("negative dims", _frame(h, dims=[-4096] * len(h["dims"]))),
        ("dims past 2**48", _frame(h, dims=[1 << 60] * len(h["dims"]))),
        ("unknown dtype code", _frame(h, layout_obj=[lay[0], [99] * n, lay[2], lay[3]])),
        ("unknown field path", _frame(h, layout_obj=[";".join(["__class__"] * n), lay[1], lay[2], lay[3]])),
        ("values not a list", _frame(h, values_obj={"x": 1})),
        ("value and dict entries on one field",
         _frame(h, layout_obj=[lay[0], lay[1], lay[2], lay[3] + ";klen;klen.4"], values_obj=vals + [3, 1])),
        ("layout id that was never sent", _frame(h, lid=h["lid"] ^ 0x5A5A5A5A, flags=h["flags"] & ~1, layout=b"")),
        ("layout lists of different lengths", _frame(h, layout_obj=[lay[0], lay[1], lay[2] + [1], lay[3]])),
        ("message version skew", _frame(h, version=MESSAGE_VERSION + 1)),
        ("schema field skew", _frame(h, schema=b"0" * 16)),
        ("layout block that does not match its id",
         _frame(h, layout_obj=[lay[0], lay[1], lay[2], lay[3]], lid=h["lid"] ^ 1)),
        ("crc32 flag with a wrong crc", _frame(h, flags=h["flags"] | 2, crc=12345)),
    ]
    return out


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


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
            _uncapture(ring)
            out["frames"] = [f for f in captured if len(f) <= KEEP_FRAME_BYTES]
            hostile = _crafted(out["frames"][0], SCHEMA_FINGERPRINT.encode())
            assert len(hostile) == N_CRAFTED
            hostile += [("mutated", _mutate(rng.choice(captured), rng)) for _ in range(MUTATED_FRAMES)]
            out["names"] = [name for name, _ in hostile]
        for i in range(N_CRAFTED + MUTATED_FRAMES):
            if rank == 0:  # a crafted frame carries the step the followers expect: its deeper
                # checks refuse it; a mutated one its captured step (refused as stale, if not sooner)
                name, frame = hostile[i]
                ring.write(frame if name == "mutated" else restep(frame, bc._ch.writer.step + 1))
                bc._ch.writer.step += 1  # the hostile message took the followers' next step
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
    import cpmeta.broadcast.wire as cb  # the one frame: its version and schema, checked once

    patches = [
        ("message version", cb, "MESSAGE_VERSION", cb.MESSAGE_VERSION + 1),
        # a follower's reader or the driver's writer holds the fingerprint it checks / stamps
        ("schema fingerprint", bc._ch.reader if rank else bc._ch.writer, "fingerprint", b"f" * 16),
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
