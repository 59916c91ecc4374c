"""Strict msgpack codec: ``encode(obj) -> bytes`` / ``decode(data) -> obj``. No pickle, ever.

Wire format (all integers little-endian)::

    offset 0      4        5        6            8             8+L
           +------+--------+--------+------------+-------------+------------------+
           |"CPMT"| version| flags=0| schema_len | schema (L B) | msgpack body ... |
           +------+--------+--------+------------+-------------+------------------+

Supported values: ``None``, ``bool``, ``int`` (int64/uint64 range), ``float``, ``str``, ``bytes``,
``list``, ``tuple`` (extension ``EXT_TUPLE``, so it round-trips as a tuple), ``dict`` with ``str``
keys, and :class:`TensorDesc` (extension ``EXT_TENSOR_DESC``: dtype name + shape). Types are
checked exactly (``type(x) is int``): subclasses such as ``IntEnum`` or ``torch.Size`` are refused
with a ``TypeError`` naming the path, e.g. ``$.klen[2]``.

``decode`` treats its input as untrusted: every failure is a :class:`CodecError` (never another
exception type), nothing is executed (no pickle, no object hooks that construct arbitrary types),
input larger than ``max_bytes`` is refused before parsing and msgpack's container/string limits are
bounded by the input length, so memory use stays proportional to the (bounded) input.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import msgpack
import torch

from . import envs

__all__ = [
    "CodecError",
    "TensorDesc",
    "encode",
    "decode",
    "encode_body",
    "decode_body",
    "schema_fingerprint",
    "MAGIC",
    "PROTOCOL_VERSION",
    "EXT_TUPLE",
    "EXT_TENSOR_DESC",
    "MAX_DEPTH",
    "MAX_SCHEMA_LEN",
    "DTYPES",
]

MAGIC = b"CPMT"
PROTOCOL_VERSION = 1
EXT_TUPLE = 1  # msgpack extension code: a tuple, payload = msgpack array
EXT_TENSOR_DESC = 2  # msgpack extension code: TensorDesc, payload = msgpack [dtype_name, [dims]]
MAX_DEPTH = 32  # deepest container nesting accepted by encode and decode
MAX_SCHEMA_LEN = 255  # bytes of caller-supplied schema fingerprint
MAX_DIMS = 16  # dimensions of a TensorDesc shape
MAX_DIM = 1 << 48  # largest single dimension of a TensorDesc
SCHEMA_FINGERPRINT_LEN = 16  # bytes returned by schema_fingerprint
_HEADER = struct.Struct("<4sBBH")
_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _dtype_table() -> dict[str, torch.dtype]:
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
             "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
             "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    return {n: getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}


DTYPES: dict[str, torch.dtype] = _dtype_table()  # wire name -> dtype (every bool/int/float dtype)
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class CodecError(ValueError):
    """Malformed, truncated, oversized, mismatched (version / schema) or otherwise bad message."""


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """Descriptor of a tensor travelling beside a message: ``dtype`` and ``shape`` (no data).

    Example: ``TensorDesc(torch.int32, (3, 4)).nbytes == 48``.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_NAMES:
            raise TypeError(f"TensorDesc.dtype: unsupported dtype {self.dtype!r}")
        if type(self.shape) is not tuple or len(self.shape) > MAX_DIMS or not all(
                type(d) is int and 0 <= d <= MAX_DIM for d in self.shape):
            raise ValueError(f"TensorDesc.shape: expected a tuple of at most {MAX_DIMS} ints in "
                             f"[0, 2**48], got {self.shape!r}")

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorDesc":
        """Descriptor of tensor ``t``."""
        return cls(t.dtype, tuple(int(d) for d in t.shape))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def schema_fingerprint(names: Iterable[str]) -> bytes:
    """16-byte fingerprint of an ordered list of names (e.g. a dataclass's field names)."""
    h = hashlib.sha256("\n".join(names).encode("utf-8"))
    return h.digest()[:SCHEMA_FINGERPRINT_LEN]


# ----------------------------------------------------------------------------- encode

def _valid(obj: Any, depth: int = 0) -> bool:
    """Fast path-free check that ``obj`` holds only supported values (see :func:`_check`)."""
    t = type(obj)
    if t is dict:
        if depth >= MAX_DEPTH:
            return False
        for k, v in obj.items():
            if type(k) is not str or (type(v) not in _SCALARS and not _valid(v, depth + 1)):
                return False
        return True
    if t is list or t is tuple:
        if _SCALARS.issuperset(map(type, obj)):
            return depth < MAX_DEPTH
        return depth < MAX_DEPTH and all(type(v) in _SCALARS or _valid(v, depth + 1) for v in obj)
    return t in _SCALARS or t is TensorDesc


def _check(obj: Any, path: str, depth: int) -> None:
    """Raise TypeError/ValueError naming the path of the first unsupported value under ``obj``."""
    t = type(obj)
    if t in _SCALARS or t is TensorDesc:
        return
    if depth >= MAX_DEPTH:
        raise ValueError(f"{path}: nesting deeper than {MAX_DEPTH} levels")
    if t is dict:
        for k, v in obj.items():
            if type(k) is not str:
                raise TypeError(f"{path}: dict key {k!r} has type {type(k).__name__}, expected str")
            if type(v) not in _SCALARS:
                _check(v, f"{path}.{k}", depth + 1)
    elif t is list or t is tuple:
        if not _SCALARS.issuperset(map(type, obj)):
            for i, v in enumerate(obj):
                if type(v) not in _SCALARS:
                    _check(v, f"{path}[{i}]", depth + 1)
    else:
        raise TypeError(f"{path}: unsupported type {t.__module__}.{t.__qualname__} (supported: None, "
                        "bool, int, float, str, bytes, list, tuple, dict[str, ...], TensorDesc)")


def _locate_pack_failure(obj: Any, path: str) -> Optional[str]:
    """Path of the leaf msgpack cannot pack (int out of range, unencodable str), else None."""
    if type(obj) is dict:
        items: Iterable[tuple[str, Any]] = ((f"{path}.{k}", v) for k, v in obj.items())
    elif type(obj) in (list, tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        try:
            _packb(obj)
        except Exception as e:  # noqa: BLE001 - report any failure by path
            return f"{path}: {e}"
        return None
    for p, v in items:
        found = _locate_pack_failure(v, p)
        if found:
            return found
    return None


def _default(obj: Any) -> msgpack.ExtType:
    if type(obj) is tuple:
        return msgpack.ExtType(EXT_TUPLE, _packb(list(obj)))
    if type(obj) is TensorDesc:
        return msgpack.ExtType(EXT_TENSOR_DESC, _packb([_DTYPE_NAMES[obj.dtype], list(obj.shape)]))
    if type(obj) is int:
        raise OverflowError(f"int {obj} outside [-2**63, 2**64-1]")
    raise TypeError(f"unsupported type {type(obj).__name__}")


#: The packer's first buffer (it grows for larger bodies). ``msgpack.packb``'s is 256 KiB: a
#: quarter-megabyte allocation for every frame's few-byte values block.
_PACK_BUF = 4096
_KEEP_BUF = 1 << 16  # the largest body whose Packer is kept for the next


def _packer() -> msgpack.Packer:
    return msgpack.Packer(use_bin_type=True, strict_types=True, default=_default, buf_size=_PACK_BUF)


def _packb(obj: Any) -> bytes:
    # a Packer per call: ``_default`` re-enters here for tuples and tensor descriptors
    return _packer().pack(obj)


_top = threading.local()  # each thread's top-level Packer (msgpack empties it after every pack, failed or not)


def _pack_top(obj: Any) -> bytes:
    """``_packb`` for a top-level body on this thread's kept Packer (a new Packer costs ~5 µs
    after an idle); taken while it packs, so a call that re-enters (a signal handler) makes its
    own. A body past ``_KEEP_BUF`` drops it (its grown buffer is not kept)."""
    p = getattr(_top, "p", None) or _packer()
    _top.p = None
    body = p.pack(obj)  # msgpack empties the Packer after a failed pack too: a failure drops it here
    _top.p = p if len(body) <= _KEEP_BUF else None
    return body


def encode_body(obj: Any, *, made: bool = False) -> bytes:
    """The msgpack body of :func:`encode` without the header, for callers that frame messages
    themselves (one header per message, e.g. the metadata broadcast frame). Same checks;
    ``made``: the caller made ``obj`` of supported values itself (no walk before packing; a
    value msgpack refuses is still named by path)."""
    if not made and not _valid(obj):
        _check(obj, "$", 0)
    try:
        return _pack_top(obj)
    except (OverflowError, ValueError, UnicodeError, TypeError) as e:
        raise ValueError(_locate_pack_failure(obj, "$") or f"$: cannot encode: {e}") from None


def encode(obj: Any, *, schema: bytes = b"") -> bytes:
    """Serialize ``obj`` to bytes: header (magic, version, ``schema``) + msgpack body.

    Raises ``TypeError`` naming the path of an unsupported value (``$`` is the root,
    ``$.a[1].b`` a nested element) and ``ValueError`` for an int outside int64/uint64, an
    unencodable string, nesting deeper than ``MAX_DEPTH`` or a schema longer than 255 bytes.
    """
    if type(schema) is not bytes or len(schema) > MAX_SCHEMA_LEN:
        raise ValueError(f"schema: expected bytes of length <= {MAX_SCHEMA_LEN}, got {schema!r:.80}")
    if not _valid(obj):
        _check(obj, "$", 0)
    try:
        body = _pack_top(obj)
    except (OverflowError, ValueError, UnicodeError, TypeError) as e:
        raise ValueError(_locate_pack_failure(obj, "$") or f"$: cannot encode: {e}") from None
    return b"".join((_HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(schema)), schema, body))


# ----------------------------------------------------------------------------- decode

class _Decoder:
    """One decode call: tracks extension nesting depth and the input-derived size limits."""

    __slots__ = ("depth", "limit")

    def __init__(self, limit: int) -> None:
        self.depth = 0
        self.limit = limit

    def unpack(self, body: Any) -> Any:
        n = self.limit
        return msgpack.unpackb(
            body, raw=False, use_list=True, strict_map_key=True, ext_hook=self.ext_hook,
            object_hook=_check_keys, max_str_len=n, max_bin_len=n,
            max_array_len=n, max_map_len=n, max_ext_len=n)

    def ext_hook(self, code: int, data: bytes) -> Any:
        self.depth += 1
        try:
            if self.depth >= MAX_DEPTH:
                raise CodecError(f"extension nesting deeper than {MAX_DEPTH}")
            if code == EXT_TUPLE:
                items = self.unpack(data)
                if type(items) is not list:
                    raise CodecError("tuple extension does not hold an array")
                return tuple(items)
            if code == EXT_TENSOR_DESC:
                return _tensor_desc(self.unpack(data))
            raise CodecError(f"unknown msgpack extension code {code}")
        finally:
            self.depth -= 1


def _check_keys(d: dict) -> dict:
    for k in d:
        if type(k) is not str:
            raise CodecError(f"map key {k!r:.40} is not a str")
    return d


def _tensor_desc(v: Any) -> TensorDesc:
    if type(v) is not list or len(v) != 2 or type(v[0]) is not str or type(v[1]) is not list:
        raise CodecError("tensor descriptor: expected [dtype_name, [dims]]")
    dtype = DTYPES.get(v[0])
    if dtype is None:
        raise CodecError(f"tensor descriptor: unknown dtype {v[0]!r:.40}")
    try:
        return TensorDesc(dtype, tuple(v[1]))
    except (TypeError, ValueError) as e:
        raise CodecError(f"tensor descriptor: {e}") from None


def decode(data: Any, *, schema: bytes = b"", max_bytes: Optional[int] = None) -> Any:
    """Parse bytes produced by :func:`encode` (any bytes-like object; parsed in place).

    ``schema`` must equal the fingerprint the sender passed (else ``CodecError`` with
    "schema fingerprint mismatch"); a different protocol version gives "protocol version
    mismatch". ``max_bytes`` defaults to ``CPMETA_MAX_MESSAGE_BYTES``. Raises only CodecError
    (and ``TypeError`` for a ``max_bytes`` that is not an int).
    """
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise CodecError(f"expected a bytes-like object, got {type(data).__name__}") from None
    limit = _limit(max_bytes)
    n = view.nbytes
    if n > limit:
        raise CodecError(f"message of {n} bytes exceeds the limit of {limit} bytes")
    if n < _HEADER.size:
        raise CodecError(f"truncated header: {n} bytes")
    magic, version, flags, schema_len = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r} (not a cpmeta transport message)")
    if version != PROTOCOL_VERSION:
        raise CodecError(f"protocol version mismatch: message has v{version}, "
                         f"this side speaks v{PROTOCOL_VERSION}")
    if flags != 0:
        raise CodecError(f"unknown header flags {flags:#x}")
    body_at = _HEADER.size + schema_len
    if body_at > n:
        raise CodecError("truncated schema fingerprint")
    if view[_HEADER.size:body_at] != schema:
        raise CodecError(f"schema fingerprint mismatch: message has "
                         f"{bytes(view[_HEADER.size:body_at]).hex()}, expected {bytes(schema).hex()}")
    return decode_body(view[body_at:], max_bytes=limit)


def _limit(max_bytes: Optional[int]) -> int:
    """A decode's byte limit: ``max_bytes``, or ``CPMETA_MAX_MESSAGE_BYTES`` for None."""
    if max_bytes is None:
        return envs.max_message_bytes()
    if not envs.is_int(max_bytes):
        raise TypeError(f"max_bytes: expected an int, got {type(max_bytes).__name__}")
    return int(max_bytes)


def decode_body(data: Any, *, max_bytes: Optional[int] = None) -> Any:
    """Strictly parse a bare msgpack body made by :func:`encode_body` (untrusted input: the same
    rules as :func:`decode`, without the header). Raises only CodecError (and ``TypeError``
    for a ``max_bytes`` that is not an int)."""
    try:
        body = memoryview(data).cast("B")
    except TypeError:
        raise CodecError(f"expected a bytes-like object, got {type(data).__name__}") from None
    n = body.nbytes
    limit = _limit(max_bytes)
    if n > limit:
        raise CodecError(f"message of {n} bytes exceeds the limit of {limit} bytes")
    try:
        obj = _Decoder(n).unpack(body)
        if not _valid(obj):  # e.g. msgpack's native timestamp (code -1): ext_hook never sees it
            _check(obj, "$", 0)
    except CodecError:
        raise
    except Exception as e:  # noqa: BLE001 - untrusted input: every failure becomes CodecError
        raise CodecError(f"malformed message body: {type(e).__name__}: {e}") from None
    return obj
