"""Tests of transport.codec: round trips, strict types with paths, hostile input, version/schema."""

from __future__ import annotations

import os
import pickle
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmeta.transport import CodecError, TensorDesc, decode, decode_body, encode
from cpmeta.transport.codec import (DTYPES, EXT_TENSOR_DESC, EXT_TUPLE, MAGIC, MAX_DEPTH, PROTOCOL_VERSION,
                             schema_fingerprint)

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=40))
descs = st.builds(lambda d, s: TensorDesc(DTYPES[d], tuple(s)), st.sampled_from(sorted(DTYPES)),
                  st.lists(st.integers(0, 1000), max_size=4))
values = st.recursive(
    scalars | descs,
    lambda inner: (st.lists(inner, max_size=6) | st.lists(inner, max_size=6).map(tuple)
                   | st.dictionaries(st.text(max_size=8), inner, max_size=6)),
    max_leaves=40)


# ----------------------------------------------------------------------------- round trips

NAMED = {
    "none": None,
    "empty_dict": {},
    "empty_list": [],
    "empty_tuple": (),
    "nested_tuple": (1, (2, [3, (4,)]), ()),
    "bool_not_int": [True, 1, False, 0],
    "int_extremes": [-(2**63), 2**64 - 1, 0],
    "floats": [0.0, -0.0, 1e308, float("inf")],
    "unicode": {"ключ": "значение ✓"},
    "bytes_with_nul": b"\x00\xff\x00",
    "tensor_desc": {"t": TensorDesc(torch.bool, (0, 3)), "u": TensorDesc(torch.bfloat16, ())},
    "metadata_like": {"num_seqs": 3, "is_prompt": True, "klen": {}, "total_k_compressed.4": 17,
                      "cu": [0, 3, 7], "opt": None},
    # past the packer's first buffer (codec._PACK_BUF), tuples packed inside the outer pack
    "larger_than_the_first_buffer": {"b": b"\x01" * 70_000, "t": [(i, (i, "x" * 40)) for i in range(2_000)]},
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_roundtrip(name: str) -> None:
    obj = NAMED[name]
    out = decode(encode(obj))
    assert out == obj and _same_types(out, obj)


def test_nan_roundtrips() -> None:
    out = decode(encode([float("nan")]))
    assert out[0] != out[0]


def _same_types(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return all(_same_types(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return all(_same_types(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return True


@SETTINGS
@given(values, st.binary(max_size=32))
def test_random_roundtrip(obj: object, schema: bytes) -> None:
    out = decode(encode(obj, schema=schema), schema=schema)
    assert out == obj and _same_types(out, obj)


def test_header_layout() -> None:
    data = encode(1, schema=b"abc")
    assert data[:4] == MAGIC and data[4] == PROTOCOL_VERSION and data[5] == 0
    assert struct.unpack_from("<H", data, 6)[0] == 3 and data[8:11] == b"abc"


def test_decode_accepts_memoryview_and_bytearray() -> None:
    data = encode({"a": (1, 2)})
    assert decode(memoryview(data)) == decode(bytearray(data)) == {"a": (1, 2)}


# ----------------------------------------------------------------------------- strict encode

@pytest.mark.parametrize("obj, path", [
    ({"a": {1: 2}}, "$.a"),
    ({"a": [1, 2, {3}]}, "$.a[2]"),
    ({"a": torch.Size([1])}, "$.a"),
    ({"a": (1, torch.zeros(1))}, "$.a[1]"),
    ([bytearray(b"x")], "$[0]"),
    ({"deep": {"x": [object()]}}, "$.deep.x[0]"),
    ({"b": {b"k": 1}}, "$.b"),
])
def test_unsupported_type_names_path(obj: object, path: str) -> None:
    with pytest.raises(TypeError) as info:
        encode(obj)
    assert str(info.value).startswith(path + ":")


def test_subclasses_refused() -> None:
    class MyInt(int):
        pass

    with pytest.raises(TypeError, match=r"^\$\[0\]: unsupported type"):
        encode([MyInt(3)])


@pytest.mark.parametrize("obj, path", [([2**64], "$[0]"), ({"x": [-(2**63) - 1]}, "$.x[0]"),
                                       ({"s": "\ud800"}, "$.s")])
def test_unencodable_values_name_path(obj: object, path: str) -> None:
    with pytest.raises(ValueError) as info:
        encode(obj)
    assert str(info.value).startswith(path + ":")


def _fresh_thread(fn, *args):  # type: ignore[no-untyped-def]
    """``fn(*args)`` on a new thread: its own, new top-level packer."""
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def test_kept_packer_packs_as_a_new_one() -> None:
    """The thread's kept top-level packer: every body equals a new packer's, after failed packs
    (an unsupported type, an int msgpack refuses) and after a body past the kept buffer."""
    from cpmeta.transport.codec import encode_body

    bodies = [{"a": [1, (2, 3)]}, [2**64], {"x": 1}, [b"\x02" * 100_000], [1, 2, 3],
              [object()], {"t": TensorDesc(torch.int32, (4, 5))}, [-(2**63) - 1], "end"]
    for obj in bodies:
        fresh = _fresh_thread(lambda o: _outcome(encode_body, o), obj)
        assert _outcome(encode_body, obj) == fresh, obj


def _outcome(fn, obj):  # type: ignore[no-untyped-def]
    try:
        return fn(obj)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)


def test_kept_packers_per_thread() -> None:
    """Threads packing at once each get their own bodies whole."""
    from concurrent.futures import ThreadPoolExecutor

    from cpmeta.transport.codec import encode_body

    objs = [{"i": i, "v": list(range(i % 50)), "s": "x" * (i % 300)} for i in range(2000)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda o: decode_body(encode_body(o)), objs))
    assert got == objs


def test_made_values_pack_the_same() -> None:
    """``encode_body(made=True)`` (a caller that made its values itself: no walk first) writes
    the same bytes; a value msgpack refuses is still named by its path."""
    from cpmeta.transport.codec import encode_body

    obj = [5, False, ["a", 7], [0, 0, 1, -2, 64, 0, 0]]
    assert encode_body(obj, made=True) == encode_body(obj)
    with pytest.raises(ValueError, match=r"^\$\[2\]\[1\]: "):
        encode_body([1, 2, [3, object()]], made=True)
    with pytest.raises(ValueError, match=r"^\$\[0\]: "):
        encode_body([2**64], made=True)


def test_depth_limit() -> None:
    obj: object = 1
    for _ in range(MAX_DEPTH + 1):
        obj = [obj]
    with pytest.raises(ValueError, match="nesting deeper"):
        encode(obj)


def test_tensor_desc_validation() -> None:
    with pytest.raises(TypeError, match="TensorDesc.dtype"):
        TensorDesc("f32", (1,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TensorDesc.shape"):
        TensorDesc(torch.int32, (-1,))
    assert TensorDesc.of(torch.zeros(2, 3, dtype=torch.int16)) == TensorDesc(torch.int16, (2, 3))
    assert TensorDesc(torch.int32, (3, 4)).nbytes == 48


def test_schema_argument_checked() -> None:
    with pytest.raises(ValueError, match="schema"):
        encode(1, schema=b"x" * 256)


# ----------------------------------------------------------------------------- version / schema

def test_schema_mismatch() -> None:
    fp = schema_fingerprint(["a", "b"])
    assert len(fp) == 16 and fp != schema_fingerprint(["b", "a"])
    data = encode({"a": 1}, schema=fp)
    assert decode(data, schema=fp) == {"a": 1}
    with pytest.raises(CodecError, match="schema fingerprint mismatch"):
        decode(data, schema=schema_fingerprint(["a"]))
    with pytest.raises(CodecError, match="schema fingerprint mismatch"):
        decode(data)


def test_version_mismatch() -> None:
    data = bytearray(encode({"a": 1}))
    data[4] = PROTOCOL_VERSION + 1
    with pytest.raises(CodecError, match="protocol version mismatch"):
        decode(bytes(data))


# ----------------------------------------------------------------------------- hostile input

_MARKER = "/tmp/cpmeta_codec_pwned_%d" % os.getpid()


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {_MARKER}",))


def test_pickle_payload_never_executes() -> None:
    payload = pickle.dumps(_Evil())
    header = encode(None)[:8]
    for data in (payload, header + payload, MAGIC + payload):
        with pytest.raises(CodecError):
            decode(data)
    # a pickle smuggled as bytes inside a valid message stays inert bytes
    assert decode(encode({"p": payload})) == {"p": payload}
    assert not os.path.exists(_MARKER)


@pytest.mark.parametrize("body, why", [
    (msgpack.packb([msgpack.Timestamp(1, 2)]), "unsupported type"),
    (msgpack.packb(msgpack.ExtType(99, b"")), "unknown msgpack extension"),
    (msgpack.packb(msgpack.ExtType(EXT_TUPLE, msgpack.packb(5))), "tuple extension"),
    (msgpack.packb(msgpack.ExtType(EXT_TENSOR_DESC, msgpack.packb(["complex32x", [1]]))), "dtype"),
    (msgpack.packb(msgpack.ExtType(EXT_TENSOR_DESC, msgpack.packb(["int32", [-1]]))), "shape"),
    (msgpack.packb({b"k": 1}, use_bin_type=True), "not a str"),
    (msgpack.packb({1: 1}), "malformed"),
    (b"\xdd\xff\xff\xff\xff", "malformed"),  # array32 claiming 4G elements
    (b"\xc6\x7f\xff\xff\xff", "malformed"),  # bin32 claiming 2 GiB
    (b"", "malformed"),
    (msgpack.packb(1) + b"\x00", "malformed"),
])
def test_crafted_bodies(body: bytes, why: str) -> None:
    with pytest.raises(CodecError, match=why):
        decode(encode(None)[:8] + body)


def test_nested_tuple_bomb_is_bounded() -> None:
    body = msgpack.packb(1)
    for _ in range(MAX_DEPTH + 5):
        body = msgpack.packb(msgpack.ExtType(EXT_TUPLE, b"\x91" + body))  # 1-element array
    with pytest.raises(CodecError):
        decode(encode(None)[:8] + body)


def test_size_limit() -> None:
    data = encode(b"x" * 1000)
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode(data, max_bytes=100)
    assert decode(data, max_bytes=len(data)) == b"x" * 1000
    with pytest.raises(TypeError, match="max_bytes: expected an int, got Tensor"):  # was torch's ambiguous truth
        decode(data, max_bytes=torch.tensor([100, 2000]))  # type: ignore[arg-type]


def test_not_bytes() -> None:
    with pytest.raises(CodecError, match="bytes-like"):
        decode(12345)  # type: ignore[arg-type]


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_codec_error(junk: bytes) -> None:
    for data in (junk, encode(None)[:8] + junk):
        try:
            decode(data)
        except CodecError:
            pass


@SETTINGS
@given(values, st.data())
def test_mutated_messages_raise_only_codec_error(obj: object, data: st.DataObject) -> None:
    msg = bytearray(encode(obj))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(msg) - 1))
        msg[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(msg)))
    try:
        decode(bytes(msg[:cut]))
    except CodecError:
        pass


def test_env_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpmeta.transport import envs

    monkeypatch.setenv(envs.FORCE_REMOTE, "yes")
    monkeypatch.setenv(envs.SHM_SLOT_SIZE, "4096")
    monkeypatch.setenv(envs.SHM_SPIN_US, "0")
    assert envs.force_remote() and envs.shm_slot_size() == 4096 and envs.shm_spin_us() == 0.0
    monkeypatch.delenv(envs.SHM_SPIN_US)
    assert envs.shm_spin_us() is None and envs.transport_timeout() == envs.DEFAULT_TIMEOUT_S
    for name, fn, bad in [(envs.FORCE_REMOTE, envs.force_remote, "maybe"),
                          (envs.SHM_NUM_SLOTS, envs.shm_num_slots, "-3"),
                          (envs.TRANSPORT_TIMEOUT, envs.transport_timeout, "soon"),
                          (envs.MAX_MESSAGE_BYTES, envs.max_message_bytes, "1.5")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            fn()
