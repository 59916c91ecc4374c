"""Fuzz of the broadcast wire (issue 26): every hostile frame is the original or a clean refusal.

Frames come from a REAL driver (``MetadataBroadcaster._send``) and go to a real follower's parse
path (``broadcast(None)`` -> ``_receive`` -> ``_consume``), in process: a loopback stands in for
the ring (``reliability_wire.loopback``), torch.distributed is faked only while the broadcasters
are built. The frame format is re-implemented in tests/reliability_wire.py (offsets, the meta crc)
as an independent reference.

Mutations (22,000 a run) of real prompt / decode / mirror / random-payload frames (first frames
with the layout block and later id-only frames; the frames of a ``persistent_outputs`` driver
copying its builder's arena whole, into a persistent follower's arena; checksum off and on):

- raw (corruption in transit): bit flips anywhere or in the header/blocks, truncation, junk
  appended, shape words +-1, FLAG_CRC cleared;
- sealed (a writer that recomputes the crcs): shape words +-1, header words, the layout id,
  FLAG_CRC cleared under the checksum.

Every outcome must be: equal to the original; or a ``RuntimeError`` naming the rank (the only
outcome for a truncated or extended frame); or -- only
for a raw change confined to the tensor bytes, checksum off -- the original with different tensor
bytes (same paths, dtypes, shapes, values, aliasing). Header, shape, layout and values corruption
is never accepted as something else. Crafted layouts with a correct id (wrong field kinds, dotted
and non-ratio keys, duplicates, 1,025 and 100,000 paths) and wrong value types are refused
naming the path. Last, 2 real ranks over the ring and the process-group path.

Seeds: ``random`` is seeded per test by tests/conftest.py (``CPMETA_HYPOTHESIS_PROFILE=explore``
or ``CPMETA_TEST_SEED`` for fresh ones). ``pytest -s`` prints the outcome counts.
"""

from __future__ import annotations

import random
import struct
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pytest
import torch

from cpmeta.fields import tensor_field
from multiproc import run_ranks
from reliability_wire import (AT, FLAG_CRC, FLAG_LAYOUT, FLAG_PACKED, FMT, HEADER, build, loopback,
                              parts, receive, reseal, restep)

pytestmark = pytest.mark.timeout(120)

MUTATIONS_PER_FRAME = 500  # x 2 frames x (8 payloads + 3 decode ones persistent) x 2 checksum settings = 22,000 per run

# ----------------------------------------------------------------------------- payloads, diff

def payloads() -> list[tuple[str, Any]]:
    """Real metadata: prompt, decode, aliased, empty dict, CP mirror, random reliability payloads."""
    import cpmeta
    from reliability_cases import make_payload
    from test_broadcast_multirank import _random_case

    out = []
    for i, is_prompt in ((0, True), (1, False), (2, True), (3, False)):
        cfg, md = _random_case(26, i, is_prompt)
        out.append((f"{'prompt' if is_prompt else 'decode'}-{i}", md))
    cfg, md = _random_case(26, 4, False)
    out.append(("decode-aliased-empty-dict", md.replace(positions_cp=md.positions, ks={})))
    cfg, md = _random_case(26, 5, True)
    out.append(("prompt-cp-mirror", cpmeta.prepare_for_mirror_cp(md, 1, 2)))
    out += [(f"reliability-{s}", make_payload(26, s, 8192)) for s in (1, 2)]
    return out


def _flat(md: Any) -> dict:
    if hasattr(md, "to_flatten_dict"):
        return md.to_flatten_dict()
    import dataclasses

    return {f.name: getattr(md, f.name) for f in dataclasses.fields(md) if getattr(md, f.name) is not None}


def _aliases(flat: dict) -> set:
    groups: dict[int, set] = {}
    for p, v in flat.items():
        if isinstance(v, torch.Tensor):
            groups.setdefault(id(v), set()).add(p)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def compare(want: Any, got: Any) -> str:
    """``equal``; ``tensor-bytes`` (only tensor bytes differ); ``empty-shape`` (only the shape
    of tensors with no elements before and after differs); else ``misread: <what>``."""
    a, b = _flat(want), _flat(got)
    if a.keys() != b.keys():
        return f"misread: paths {sorted(a.keys() ^ b.keys())}"
    if _aliases(a) != _aliases(b):
        return "misread: aliasing"
    found = "equal"
    for p, x in a.items():
        y = b[p]
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype:
                return f"misread: {p} {y!r:.40}"
            if x.shape != y.shape:
                if x.numel() or y.numel():
                    return f"misread: {p} {tuple(x.shape)} -> {tuple(y.shape)}"
                found = "empty-shape"
            elif not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
                if found == "equal":
                    found = "tensor-bytes"
        elif type(x) is not type(y) or x != y:
            return f"misread: value {p} {y!r:.40}"
    return found


# ----------------------------------------------------------------------------- mutations

def mutate(frame: bytes, rng: random.Random, checksum: bool) -> tuple[str, bytes, bool, int]:
    """``(kind, frame, sealed, first changed byte)`` of one random mutation (a flip of the crc
    word, which a frame without FLAG_CRC does not use, is not counted as the first change)."""
    p = parts(frame)
    b = bytearray(frame)
    op = rng.randrange(10)
    if op in (0, 1):  # raw bit flips anywhere / before the tensors
        hi = len(b) if op == 0 else p["data_at"]
        at = sorted(rng.randrange(hi) for _ in range(rng.randint(1, 3)))
        for i in at:
            b[i] ^= 1 << rng.randrange(8)
        used = [i for i in at if b[i] != frame[i]  # two flips of one bit cancel out
                and not AT["crc"] <= i < AT["crc"] + 4] or [len(b)]
        return ("flip" if op == 0 else "flip-head"), bytes(b), False, used[0]
    if op == 2:
        cut = rng.randrange(len(b))
        return "truncate", bytes(b[:cut]), rng.random() < 0.5, cut
    if op == 3:
        return "extend", bytes(b) + rng.randbytes(rng.randint(1, 64)), rng.random() < 0.5, len(b)
    if op in (4, 5) and p["n_dims"]:  # a shape word +-1, raw or sealed
        k = rng.randrange(p["n_dims"])
        at = p["shapes_at"] + 8 * k
        struct.pack_into("<q", b, at, p["dims"][k] + rng.choice((-1, 1)))
        return ("shape" if op == 5 else "shape-raw"), bytes(b), op == 5, at
    if op == 6:  # a header word, sealed
        name = rng.choice(("llen", "vlen", "n_dims", "tbytes", "flags", "lid", "step"))
        fmt = FMT.get(name, "<I")
        (old,) = struct.unpack_from(fmt, b, AT[name])
        new = rng.choice((old + 1, old - 1, old ^ (1 << rng.randrange(16)), 0, 1 << 31)) if \
            name != "flags" else old ^ rng.choice((FLAG_LAYOUT, FLAG_PACKED, FLAG_CRC, 8))
        struct.pack_into(fmt, b, AT[name], new % (1 << (8 * struct.calcsize(fmt))))
        return f"header-{name}", bytes(b), True, AT[name]
    if op == 7 and p["flags"] & FLAG_CRC:  # the flag cleared: raw and sealed
        struct.pack_into("<H", b, AT["flags"], p["flags"] & ~FLAG_CRC)
        sealed = rng.random() < 0.5
        return ("clear-crc" if sealed else "clear-crc-raw"), bytes(b), sealed, AT["flags"]
    # op 8, 9 (and the skipped cases): bytes inside the tensor region only, raw
    if len(b) > p["data_at"]:
        i = rng.randrange(p["data_at"], len(b))
        b[i] ^= 1 << rng.randrange(8)
        return "tensor-byte", bytes(b), False, i
    return "noop", bytes(b), False, len(b)


def _outcome(fol: Any, want: Any, frame: bytes, step: int) -> tuple[str, str]:
    try:
        got = receive(fol, frame, step)  # the follower expects the original frame's step
    except RuntimeError as e:
        return ("refused" if "rank 1" in str(e) else "refused-unnamed"), str(e)
    except Exception as e:  # noqa: BLE001 - anything else is a finding
        return f"unclean {type(e).__name__}", str(e)
    return compare(want, got), ""


def _allowed(kind: str, outcome: str, sealed: bool, first: int, data_at: int, checksum: bool,
             same_length: bool) -> bool:
    if kind in ("truncate", "extend"):  # the frame's length is exact on every path
        return outcome == "refused"
    if outcome in ("equal", "refused"):
        return True
    if outcome == "tensor-bytes":  # only raw changes confined to the tensor bytes, checksum off
        return not checksum and not sealed and first >= data_at and same_length
    # a writer that recomputes the crcs can resize a tensor with no elements ([0, 4] -> [0, 5]):
    # no byte count changes; only the meta crc protects those dims against corruption in transit
    return outcome == "empty-shape" and kind == "shape" and sealed


def _drive(make: Any, persistent: bool, checksum: bool) -> Iterator[tuple[str, Any, bytes, Any]]:
    """``(payload name, metadata, frame, follower holding its layout)`` for the first and a later
    frame of every payload; persistent: decode payloads from a persistent_outputs driver (the
    builder's arena is the frame's region: one copy) to a persistent follower."""
    drv = make(0, checksum, persistent)
    for name, md in payloads():
        if persistent and not name.startswith("decode-"):
            continue
        drv.broadcast(md)
        drv.broadcast(md)
        first, later = drv._objects.frames[-2:]
        assert parts(first)["flags"] & FLAG_LAYOUT and not parts(later)["flags"] & FLAG_LAYOUT
        assert parts(later)["flags"] & FLAG_PACKED
        for orig in (first, later):
            fol = make(1, checksum, persistent)
            assert compare(md, receive(fol, first)) == "equal"  # it holds the layout now
            yield name + ("-arena" if persistent else ""), md, orig, fol
            assert compare(md, receive(fol, later)) == "equal"  # still in step


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
def test_mutated_real_frames_are_equal_or_refused(checksum: bool) -> None:
    rng = random.Random(random.randrange(1 << 30))
    counts: dict[tuple[str, str], int] = {}
    bad = []
    with loopback() as make:
        for persistent in (False, True):
            for name, md, orig, fol in _drive(make, persistent, checksum):
                for _ in range(MUTATIONS_PER_FRAME):
                    kind, frame, sealed, at = mutate(orig, rng, checksum)
                    if sealed:
                        frame = reseal(frame)
                    outcome, msg = _outcome(fol, md, frame, parts(orig)["step"])
                    key = (kind + ("-arena" if persistent else ""), outcome.split(":")[0])
                    counts[key] = counts.get(key, 0) + 1
                    if not _allowed(kind, outcome, sealed, at, parts(orig)["data_at"], checksum,
                                    len(frame) == len(orig)):
                        bad.append((name, kind, sealed, outcome, msg[:160]))
    total = sum(counts.values())
    print(f"\nwire fuzz checksum={checksum}: {total} mutations; " + ", ".join(
        f"{k}/{o}: {n}" for (k, o), n in sorted(counts.items())))
    assert total >= 1000
    assert not bad, bad[:10]


def test_shape_word_off_by_one_is_refused_naming_the_field() -> None:
    """Finding 1 of issue 26: a bool tensor one element longer fitted in the run's padding and
    was accepted, the next field shifted by a byte. Now refused, the changed field named."""
    md, _ = _base()  # gate_force_random: bool [3], alone in its run (3 bytes, padded to 16)
    with loopback() as make:
        drv, fol = make(0, False), make(1, False)
        drv.broadcast(md)
        drv.broadcast(md)
        first, later = drv._objects.frames[-2:]
        receive(fol, first)
        p = parts(later)
        assert p["dims"][0] == 3  # 4 bytes would still round to 16: v4's check let it pass
        frame = bytearray(later)
        struct.pack_into("<q", frame, p["shapes_at"], p["dims"][0] + 1)  # first tensor: a bool
        with pytest.raises(RuntimeError) as e:
            receive(fol, reseal(frame))
    n = p["dims"][0]
    assert "rank 1" in str(e.value) and f"gate_force_random [{n + 1}] bool (was [{n}])" in str(e.value)


# ----------------------------------------------------------------------------- crafted layouts

def _base() -> tuple[Any, bytes]:
    from cpmeta.metadata import InputMetadata

    i32 = torch.int32
    md = InputMetadata(
        is_prompt=False, num_seqs=2, total_q=3, positions=torch.arange(3, dtype=i32),
        positions_c={"4": torch.arange(3, dtype=i32)}, klen={"4": torch.ones(3, dtype=i32)},
        ks={}, total_k_compressed={"4": 7}, block_tables=torch.arange(6, dtype=i32).view(3, 2),
        gate_force_random=torch.zeros(3, dtype=torch.bool))
    with loopback() as make:
        drv = make(0, False)
        drv.broadcast(md)
    return md, drv._objects.frames[-1]


def _crafted(frame: bytes) -> list[tuple[str, str, bytes]]:
    """(name, text the refusal must contain, sealed frame) built from one valid first frame."""
    from cpmeta.transport import decode_body

    p = parts(frame)
    lay = decode_body(frame[HEADER.size:HEADER.size + p["llen"]])
    vals = decode_body(frame[HEADER.size + p["llen"]:HEADER.size + p["llen"] + p["vlen"]])
    paths, codes, ndims, vpaths = lay
    data = frame[p["data_at"]:]

    def f(tp: str = paths, vp: str = vpaths, v: list = vals, c: list = codes, nd: list = ndims,
          dims: list = p["dims"]) -> bytes:
        return build([tp, c, nd, vp], v, dims, data, p["flags"], tbytes=p["tbytes"])

    def tpath(old: str, new: str) -> str:
        ps = paths.split(";")
        assert old in ps, (old, ps)
        return ";".join(new if x == old else x for x in ps)

    vi = vpaths.split(";")
    big = ";".join(f"klen.{k}" for k in range(1, 1026))
    huge = ";".join(f"klen.{k}" for k in range(1, 100_001))
    return [
        ("tensor at a value field", "cp_size", f(tp=tpath("positions", "cp_size"))),
        ("tensor at a value dict", "total_k_compressed", f(tp=tpath("positions", "total_k_compressed.4"))),
        ("tensor at is_prompt", "is_prompt", f(tp=tpath("positions", "is_prompt"))),
        ("value at a tensor field", "context_lens", f(vp=vpaths + ";context_lens", v=vals + [5])),
        ("value entry in a tensor dict", "ke.4", f(vp=vpaths + ";ke.4", v=vals + [5])),
        ("dotted key", "positions_c.4.5", f(tp=tpath("positions_c.4", "positions_c.4.5"))),
        ("non-ratio key x", "klen.x", f(tp=tpath("klen.4", "klen.x"))),
        ("leading zero key", "klen.04", f(tp=tpath("klen.4", "klen.04"))),
        ("non-ascii digit key", "klen.", f(tp=tpath("klen.4", "klen.\u0663"))),
        ("empty key", "klen.", f(tp=tpath("klen.4", "klen."))),
        ("two tensors, one path", "positions", f(tp=tpath("klen.4", "positions"))),
        ("alias of itself", "positions", f(tp=tpath("positions", "positions,positions"))),
        ("value path twice", "num_seqs", f(vp=vpaths + ";num_seqs", v=vals + [2])),
        ("whole and entries", "klen", f(vp=vpaths + ";klen", v=vals + [{}])),
        ("unknown field", "__class__", f(tp=tpath("positions", "__class__"))),
        ("1,025 paths", "MAX_LAYOUT_PATHS", f(vp=vpaths + ";" + big, v=vals + [1] * 1025)),
        ("100,000 paths", "MAX_LAYOUT_BYTES", f(vp=vpaths + ";" + huge, v=vals + [1] * 100_000)),
        ("values block of 1.8 MB", "MAX_VALUES_BYTES", f(v=vals[:-1] + [list(range(1 << 18))])),
        ("rank 17 tensor", "bad tensor rank", f(nd=[17] + ndims[1:])),
        ("codes out of order", "ordered", f(c=codes[::-1])),
        ("is_prompt = 1", "is_prompt", f(v=[1 if x == "is_prompt" else y for x, y in zip(vi, vals)])),
        ("is_prompt = 'yes'", "is_prompt", f(v=["yes" if x == "is_prompt" else y for x, y in zip(vi, vals)])),
        ("is_prompt = None", "is_prompt", f(v=[None if x == "is_prompt" else y for x, y in zip(vi, vals)])),
        ("num_seqs = 1.5", "num_seqs", f(v=[1.5 if x == "num_seqs" else y for x, y in zip(vi, vals)])),
        ("num_seqs = [1, 2]", "num_seqs", f(v=[[1, 2] if x == "num_seqs" else y for x, y in zip(vi, vals)])),
        ("num_seqs = -1", "num_seqs", f(v=[-1 if x == "num_seqs" else y for x, y in zip(vi, vals)])),
        ("num_seqs = True", "num_seqs", f(v=[True if x == "num_seqs" else y for x, y in zip(vi, vals)])),
        ("num_seqs = 2**64-1", "num_seqs", f(v=[2**64 - 1 if x == "num_seqs" else y for x, y in zip(vi, vals)])),
        ("cp_size = 0", "cp_size", f(vp=vpaths + ";cp_size", v=vals + [0])),
        ("count entry < 0", "total_k_compressed.4",
         f(v=[-3 if x == "total_k_compressed.4" else y for x, y in zip(vi, vals)])),
        ("empty dict not empty", "ks", f(v=[{"4": 1} if x == "ks" else y for x, y in zip(vi, vals)])),
        ("values count", "values", f(v=vals + [1])),
    ]


def test_crafted_layouts_and_values_are_refused_by_path() -> None:
    md, frame = _base()
    with loopback() as make:
        for name, want, hostile in _crafted(frame):
            fol = make(1, False)
            t0 = time.perf_counter()
            with pytest.raises(RuntimeError) as e:
                receive(fol, hostile)
            dt = time.perf_counter() - t0
            msg = str(e.value)
            assert "rank 1" in msg and want in msg, (name, msg)
            if "paths" in name:
                print(f"{name}: refused in {dt * 1e3:.2f} ms: {msg[:120]}")
            assert compare(md, receive(fol, frame)) == "equal", name  # and the next frame is fine


def test_largest_allowed_layout_is_accepted_and_linear() -> None:
    """1,024 paths (MAX_LAYOUT_PATHS) build a plan; plan construction is linear in the paths
    (the old ``sum(ndims[:i])`` per tensor was quadratic): checked by counting, not timing."""
    from cpmeta.broadcast import plan as planning
    from cpmeta.broadcast.schema import INPUT_METADATA, MAX_LAYOUT_PATHS

    n = MAX_LAYOUT_PATHS - 1
    paths = ";".join(["positions"] + [f"klen.{k}" for k in range(1, n + 1)])
    plan = planning.Plan(INPUT_METADATA, paths, [4] * (n + 1), [1] * (n + 1), "")
    assert len(plan.targets) == n + 1 and plan.n_dims == n + 1
    with pytest.raises(ValueError, match="MAX_LAYOUT_PATHS"):
        planning.Plan(INPUT_METADATA, paths + ";ke.1", [4] * (n + 2), [1] * (n + 2), "")
    calls = [0]
    real = planning.accumulate

    def counting(xs: Any) -> Any:
        calls[0] += 1
        return real(xs)

    planning.accumulate = counting  # type: ignore[assignment]
    try:
        planning.Plan(INPUT_METADATA, paths, [4] * (n + 1), [1] * (n + 1), "")
    finally:
        planning.accumulate = real  # type: ignore[assignment]
    assert calls[0] == 1  # one pass over the ranks, whatever the number of tensors


def test_driver_refuses_metadata_the_schema_does_not_allow() -> None:
    """The driver checks too: the user's bad value is its ValueError naming the path, before
    its frame is written: the followers get only an abort frame for that step (issue 38), which
    they refuse naming the step and the driver's error; the layout of the refused step is then
    still sent with the next frame that uses it (it was never on the wire)."""
    md, _ = _base()
    cases = [(md.replace(is_prompt=1), "is_prompt"), (md.replace(num_seqs=-2), "num_seqs"),
             (md.replace(klen={"x": torch.ones(3, dtype=torch.int32)}), "klen.x"),
             (md.replace(klen={"4": 5}), "klen.4"), (md.replace(cp_size=torch.ones(1)), "cp_size")]
    with loopback() as make:
        drv = make(0, False)
        for bad, path in cases:
            n = len(drv._objects.frames)
            with pytest.raises(ValueError, match=path.replace(".", r"\.")) as e:
                drv.broadcast(bad)
            assert len(drv._objects.frames) == n + 1 and parts(drv._objects.frames[-1])["flags"] & 16
            with pytest.raises(ValueError) as f:  # FLAG_ABORT: the follower raises the same class
                receive(make(1, False), drv._objects.frames[-1])
            assert "rank 1: step" in str(f.value) and str(e.value) in str(f.value), str(f.value)
        drv.broadcast(md)  # the layout of the refused is_prompt=1 / num_seqs=-2 steps
        assert compare(md, receive(make(1, False), drv._objects.frames[-1])) == "equal"


# ----------------------------------------------------------------------------- 2 real ranks

def _hostile_rank(rank: int, world: int, seed: int) -> list[str]:
    """Valid steps, then (rank 0) two sealed hostile frames written raw into the ring or the
    process group: a shape word +1, and FLAG_CRC cleared (the group runs with the checksum)."""
    import cpmeta
    from reliability_cases import make_payload, verify_payload
    from cpmeta.transport._dist import bcast_frame

    out = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=30.0) as bc:
        assert bc.checksum
        ch = bc._objects
        for step in range(3):
            verify_payload(bc.broadcast(make_payload(seed, step, 8192) if rank == 0 else None), step)
        hostile: list[bytes] = []
        if rank == 0:
            with loopback() as make:
                drv = make(0, True)
                drv.broadcast(make_payload(seed, 3, 8192))
                frame = drv._objects.frames[-1]
            frame = restep(frame, 4)  # the step the followers expect next
            p = parts(frame)
            b = bytearray(frame)
            struct.pack_into("<q", b, p["shapes_at"], p["dims"][0] + 1)
            hostile.append(reseal(b))
            c = bytearray(frame)
            struct.pack_into("<H", c, AT["flags"], p["flags"] & ~FLAG_CRC)
            hostile.append(reseal(c))
        for i in range(2):
            if rank == 0:
                if ch._remote_group is not None:
                    bcast_frame(torch.frombuffer(bytearray(hostile[i]), dtype=torch.uint8), 0,
                                ch._remote_group)
                else:
                    ch.ring.write(hostile[i])
                bc._ch.writer.step += 1  # the hostile message took the followers' next step
                out.append("sent")
            else:
                try:
                    bc.broadcast(None)
                    out.append("accepted")
                except RuntimeError as e:
                    out.append(str(e))
        verify_payload(bc.broadcast(make_payload(seed, 9, 8192) if rank == 0 else None), 9)
        out.append("remote" if ch._remote_group is not None else "ring")
    return out


@pytest.mark.parametrize("remote", [False, True], ids=["ring", "process-group"])
def test_two_ranks_refuse_shape_and_cleared_flag(remote: bool) -> None:
    env = {"CPMETA_CHECKSUM": "1", "CPMETA_FORCE_REMOTE": "1" if remote else "0"}
    _, fol = run_ranks(_hostile_rank, 2, random.randrange(1 << 20), env=env, timeout=100)
    shape, flag, path = fol
    assert path == ("remote" if remote else "ring")
    assert "rank 1" in shape and "tensor shapes declare" in shape, shape
    assert "rank 1" in flag and "no crc32" in flag, flag


def _redeclared(frame: bytes) -> list[tuple[str, str, bytes]]:
    """Sealed frames that re-declare a real frame's tensors with the SAME bytes: every run of a
    dtype as another dtype of its element size, every tensor one rank higher (``[d] -> [d, 1]``),
    every ``[n, 4]`` / ``[n, 2]`` tensor reshaped to keep its numel (``[n, 4] -> [2n, 2]``). The
    exact sizes cannot see any of these; the schema's pinned dtypes, ranks and fixed dims must."""
    from cpmeta.transport import decode_body

    p = parts(frame)
    paths, codes, ndims, vpaths = decode_body(frame[HEADER.size:HEADER.size + p["llen"]])
    vals = decode_body(frame[HEADER.size + p["llen"]:HEADER.size + p["llen"] + p["vlen"]])
    data, dims = frame[p["data_at"]:], p["dims"]

    def f(c: list = codes, nd: list = ndims, d: list = dims) -> bytes:
        return build([paths, c, nd, vpaths], vals, d, data, p["flags"], tbytes=p["tbytes"],
                     step=p["step"], fingerprint=frame[8:24])

    names = [x.split(",")[0] for x in paths.split(";")]
    same_size = {0: 1, 4: 8, 5: 9}  # bool -> uint8, int32 -> float32, int64 -> float64
    out = []
    for code, other in same_size.items():
        if code in codes:
            first = names[codes.index(code)]
            out.append((f"run of code {code} as {other}", first, f(c=[other if x == code else x for x in codes])))
    at = 0
    for i, (name, nd) in enumerate(zip(names, ndims)):
        if nd == 1:
            out.append((f"{name} one rank higher", name,
                        f(nd=ndims[:i] + [2] + ndims[i + 1:], d=dims[:at + 1] + [1] + dims[at + 1:])))
        if nd == 2 and dims[at + 1] in (2, 4) and dims[at] % 2 == 0 and dims[at]:
            out.append((f"{name} reshaped", name,
                        f(d=dims[:at] + [dims[at] * 2, dims[at + 1] // 2] + dims[at + 2:])))
        at += nd
    return out


@dataclass
class Pinned:
    """Any dataclass (``schema=``) whose tensors pin dtype, ndim and a fixed dim through the
    field table's ``tensor_field`` (what ``InputMetadata`` does)."""

    ids: Optional[torch.Tensor] = tensor_field(torch.int32, ("total_q",))
    pairs: Optional[torch.Tensor] = tensor_field(torch.int32, ("total_q", 2))
    mask: Optional[torch.Tensor] = tensor_field(torch.bool, ("total_q",))
    wide: Optional[torch.Tensor] = tensor_field(torch.int64, ("total_q",))
    n: Optional[int] = None


def _paths() -> Iterator[tuple[str, Any, dict, bool]]:
    """``(path, metadata, broadcaster arguments, persistent)``: every way a frame carries tensors."""
    prompt = payloads()[0][1]  # a real prompt step: [n, 4] load plans and pivots, bool masks, int32
    decode = next(md for name, md in payloads() if name.startswith("decode-"))
    yield "packed", prompt, {}, False
    yield "persistent arena", decode, {}, True
    yield "persistent packed", _separate(prompt), {}, True
    yield "collective", prompt, {"tensor_path": "collective"}, False
    g = torch.Generator().manual_seed(5)
    pinned = Pinned(torch.randint(0, 9, (6,), dtype=torch.int32, generator=g),
                    torch.randint(0, 9, (6, 2), dtype=torch.int32, generator=g),
                    torch.rand(6, generator=g) > 0.5, torch.arange(6), 3)
    yield "any dataclass", pinned, {"schema": Pinned}, False


def _separate(md: Any) -> Any:
    """``md`` with every tensor its own allocation (a persistent driver then packs its frame)."""
    import dataclasses

    def own(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.clone()
        return {k: own(x) for k, x in v.items()} if isinstance(v, dict) else v

    return md.replace(**{f.name: own(getattr(md, f.name)) for f in dataclasses.fields(md)})


def _fixes(schema: Any, field: str) -> bool:
    return bool(schema.specs[field.split(".")[0]].fixed)


@pytest.mark.parametrize("path", ["packed", "persistent arena", "persistent packed", "collective",
                                  "any dataclass"])
def test_redeclared_dtypes_ranks_and_fixed_dims_are_refused_by_path(path: str) -> None:
    """Issue 33 / 38: a writer that recomputes the crcs could re-declare int32 tensors as float32
    (152 of 152 such changes were accepted before the schema pinned dtypes and ranks), and on the
    persistent path a fixed dim (44 of 391 crafted frames were accepted). Every accepted wrong
    dtype, ndim or fixed dim counts as a failure, on every path a frame can take."""
    name, md, kw, persistent = next(p for p in _paths() if p[0] == path)
    with loopback() as make:
        drv = make(0, False, persistent, **kw)
        drv.broadcast(md)
        frame = drv._objects.frames[-1]
        assert (parts(frame)["flags"] & FLAG_PACKED) == (0 if path == "collective" else FLAG_PACKED), path
        schema = drv.schema
        hostile = [h for h in _redeclared(frame) if "reshaped" not in h[0] or _fixes(schema, h[1])]
        assert len(hostile) >= 4 and any("reshaped" in n for n, _, _ in hostile), [n for n, _, _ in hostile]
        accepted = []
        for what, want, bad in hostile:
            fol = make(1, False, persistent, **kw)
            try:
                receive(fol, bad)
                accepted.append(what)
                continue
            except RuntimeError as e:
                msg = str(e)
            named = want in msg and ("pins" in msg or "fixes" in msg)
            assert "rank 1" in msg and (named or "not ordered by dtype code" in msg), (what, msg)
            assert compare(md, receive(fol, frame)) == "equal", what  # and the next frame is fine
        assert not accepted, f"{path}: accepted {accepted}"
