"""A tensor dict on the frame (``cpmeta.broadcast_tensor_dict``): its tree as one value, its tensors.

vLLM's callers send dicts whose values are tensors, plain values, nested dicts, lists and tuples
of those, enums, with str or int keys. One such dict travels as ONE frame of a flat dict:

* ``"#tree"``: a flat list of plain scalars (the tree, in prefix order, tensors by index),
  msgpack in the values block;
* one entry per distinct tensor (by object: a tensor under two paths is sent once and is one
  tensor on every rank), labelled by its first path (``attn.block_tables``; ``#<i>`` when that
  path is not 1-48 printable ASCII characters without ``;`` / ``,``, starts with ``#`` or repeats).

Tree tokens: a scalar leaf is ``VAL, value``; a tensor ``TENSOR, i``; a dict ``DICT, n`` then
``n`` times ``key, node``; a list ``LIST, n`` / a tuple ``TUPLE, n`` then ``n`` nodes. Worked
example: ``{"ids": t, "n": 3, 7: (None, t)}`` -> tokens ``[2, 3, "ids", 1, 0, "n", 0, 3, 7, 4,
2, 0, None, 1, 0]`` and tensors ``[t]`` (label ``ids``; the second ``t`` is the same index 0).

Values: ``None``, ``bool``, ``int`` (int64), ``float``, ``str`` (exact types), and enums, sent as
their ``.value`` (which must itself be one of these, or a container of them). Keys: str, int,
bool, float, None, or an enum of those (sent as its value; two keys equal once converted are
refused). Limits: nesting at most :data:`MAX_DEPTH` levels, at most :data:`MAX_TENSORS` distinct
tensors per dict (the frame's ``MAX_LAYOUT_PATHS`` less the tree): anything else is a
``TypeError`` on the driver naming the path (``attn.seq_lens.2: int64 ... cannot be broadcast``),
before anything is sent. The tree's msgpack is at most the frame's ``MAX_VALUES_BYTES`` (1 MiB:
about 90,000 entries of a short str key and an int; a ``ValueError`` on the driver). A follower
refuses a tree that does not parse (``ValueError`` naming the token).
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Any, Optional

import torch

from ..cache import BoundedCache
from .schema import MAX_LAYOUT_PATHS
from .value_check import MAX_INT, MIN_INT, LayoutError

__all__ = ["DictSchema", "TreeCheck", "check_dict_key", "encode_tree", "decode_tree", "token_path", "TREE_KEY",
           "MAX_DEPTH", "MAX_TENSORS", "MAX_LABEL"]

TREE_KEY = "#tree"
MAX_DEPTH = 32  # nesting levels of dicts / lists / tuples (and enum values) below the top dict
MAX_TENSORS = MAX_LAYOUT_PATHS - 1  # distinct tensors per dict: every layout path but the tree's
MAX_LABEL = 48  # characters of a tensor's label (1023 labels stay inside the layout block)
VAL, TENSOR, DICT, LIST, TUPLE = 0, 1, 2, 3, 4
_SCALARS = frozenset({type(None), bool, int, float, str})
_FAST = frozenset({type(None), bool, float, str})  # scalars without a range to check
_TENSOR = torch.Tensor
_LABELS: BoundedCache[tuple, list[str]] = BoundedCache(256)  # tensors' paths -> their labels
_WHAT = "plain values: None, bool, int, float, str, enums of those, tensors, and dicts / lists / tuples of them"


class DictSchema:
    """The schema of a tensor-dict frame (module doc): value path ``#tree``, one tensor path
    (label) per distinct tensor, the driver's key order (the tree first, tensors by index).

    A layout is checked once: exactly one value path, ``#tree``; labels 1-48 printable ASCII
    characters without ``;`` / ``,``, unique, never ``#tree``. Per frame the tree is a list of
    plain scalars (:class:`TreeCheck`, on the driver as on every follower); its structure is
    proven by :func:`decode_tree`. Example: ``{"#tree": [2, 1, "ids", 1, 0], "ids": t}`` ->
    tensor path ``ids``, value path ``#tree``.
    """

    name = "tensor dict"
    dict_keys = "dict"
    fingerprint = hashlib.sha256(b"v2|cpmeta.tensor_dict|tree").hexdigest()[:16]

    def check_layout(self, tensor_paths: list[list[str]], value_paths: list[str]
                     ) -> tuple[list[list[tuple[str, Optional[str]]]], list[tuple[str, Optional[str]]]]:
        n = sum(map(len, tensor_paths)) + len(value_paths)
        if n > MAX_LAYOUT_PATHS:
            raise LayoutError(f"layout has {n} paths, more than MAX_LAYOUT_PATHS={MAX_LAYOUT_PATHS}")
        if value_paths != [TREE_KEY]:
            raise LayoutError(f"tensor-dict layout: value paths {value_paths[:4]!r:.80}, expected "
                              f"[{TREE_KEY!r}]")
        seen: set[str] = set()
        for p in [p for ps in tensor_paths for p in ps]:
            if not _label_ok(p) or p in seen:
                raise LayoutError(f"tensor label {p!r:.80}: expected a unique str of 1-{MAX_LABEL} "
                                  "printable ASCII characters without ';' or ',', not starting with '#' "
                                  "(or '#<index>')")
            seen.add(p)
        return [[(p, None) for p in ps] for ps in tensor_paths], [(TREE_KEY, None)]

    def check_tensors(self, targets: Any, dtypes: Any, ndims: Any) -> None:
        return None

    def fixed_dims(self, targets: Any, ndims: Any) -> list[tuple[int, int, str]]:
        return []

    def value_check(self, targets: list[tuple[str, Optional[str]]]) -> "TreeCheck":
        return TreeCheck()


class TreeCheck:
    """Per frame: the values block is ``[tree]``, the tree a list of plain scalars, in one
    C-level pass over the tokens' types (:func:`encode_tree` keeps ints in int64; the codec
    decodes none outside uint64). Example: ``[[2, 1, "n", 0, 3]]`` passes; ``[[2, 1, "n", 0,
    [3]]]`` is refused (a list token)."""

    def __call__(self, values: Any) -> None:
        if type(values) is not list or len(values) != 1 or type(values[0]) is not list:
            raise LayoutError(f"values block: expected [tree], the tree a list of tokens, got "
                              f"{values!r:.60}")
        tokens = values[0]
        if not _SCALARS.issuperset(map(type, tokens)):
            bad = next(t for t in tokens if type(t) not in _SCALARS)
            raise LayoutError(f"{TREE_KEY}: token {type(bad).__name__} {bad!r:.40} is not a plain "
                              "scalar (None, bool, int, float, str)")


def check_dict_key(key: Any) -> None:
    """Refuse a key of the flat frame dict (``#tree`` or a tensor label) that is not 1-256
    printable ASCII characters without ``;`` / ``,`` (``cpmeta.broadcast.collect.collect_dict``)."""
    if not (type(key) is str and 0 < len(key) <= 256 and key.isascii() and key.isprintable()
            and ";" not in key and "," not in key):
        raise LayoutError(f"key {key!r:.80}: expected a str of 1-256 printable ASCII characters "
                          "without ';' or ','")


def _label_ok(p: Any) -> bool:
    if type(p) is not str or not 0 < len(p) <= MAX_LABEL or not p.isascii() or not p.isprintable() \
            or ";" in p or "," in p:
        return False
    return p[0] != "#" or (p[1:].isdigit() and len(p) > 1)


# ---- the driver: dict -> (tokens, tensors, labels) --------------------------------------------
def encode_tree(d: dict) -> tuple[list[Any], list[torch.Tensor], list[str]]:
    """``(tokens, tensors, labels)`` of the driver's dict (module doc; ``TypeError`` naming the
    path for anything that cannot travel). Example: ``{"ids": t, "n": 3}`` -> ``([2, 2, "ids",
    1, 0, "n", 0, 3], [t], ["ids"])``."""
    if type(d) is not dict:
        raise TypeError(f"tensor_dict: expected a dict, got {type(d).__name__}")
    tokens: list[Any] = []
    tensors: list[torch.Tensor] = []
    paths: list[tuple] = []
    _encode(d, tokens, tensors, paths, {}, (), 0)
    if len(tensors) > MAX_TENSORS:
        raise TypeError(f"tensor_dict: {len(tensors)} distinct tensors, at most MAX_TENSORS="
                        f"{MAX_TENSORS} travel in one frame")
    key = tuple(paths)
    labels = _LABELS.get(key)
    if labels is None:
        labels = _LABELS.put(key, _labels(paths))
    return tokens, tensors, labels


def _labels(paths: list[tuple]) -> list[str]:
    """Each tensor's label: its first path as text when that is a valid, new label not starting
    with ``#``, else ``#<index>``. Example: ``[((), "ids"), (((), "kv"), 0)]`` -> ``["ids",
    "kv.0"]``."""
    labels: list[str] = []
    used = {TREE_KEY}
    for i, p in enumerate(paths):
        text = _path_text(p)
        if not _label_ok(text) or text[0] == "#" or text in used:
            text = f"#{i}"
        used.add(text)
        labels.append(text)
    return labels


def _encode(v: Any, out: list[Any], tensors: list[torch.Tensor], paths: list[tuple],
            seen: dict[int, int], path: tuple, depth: int) -> None:
    t = type(v)
    if t in _SCALARS:
        if t is int and not MIN_INT <= v <= MAX_INT:
            raise TypeError(f"{_path_text(path)}: int {v} is outside int64")
        out += (VAL, v)
    elif isinstance(v, torch.Tensor):
        i = seen.get(id(v))
        if i is None:
            i = seen[id(v)] = len(tensors)
            tensors.append(v)
            paths.append(path)
        out += (TENSOR, i)
    elif t is dict or t is list or t is tuple or isinstance(v, Enum):
        if depth >= MAX_DEPTH:
            raise TypeError(f"{_path_text(path)}: nested deeper than MAX_DEPTH={MAX_DEPTH} levels")
        if t is dict:
            out += (DICT, len(v))
            converted = False
            for k, x in v.items():
                if type(k) not in _SCALARS:
                    k = _enum_key(k, path)
                    converted = True
                tx = type(x)
                if tx in _FAST or (tx is int and MIN_INT <= x <= MAX_INT):  # most entries: inline
                    out += (k, VAL, x)
                elif tx is _TENSOR and id(x) in seen:
                    out += (k, TENSOR, seen[id(x)])
                else:
                    out.append(k)
                    _encode(x, out, tensors, paths, seen, (path, k), depth + 1)
            if converted and len({_key_of(k) for k in v}) != len(v):
                raise TypeError(f"{_path_text(path) or 'tensor_dict'}: two keys are equal once enums "
                                f"are sent as their values ({list(v)!r:.80})")
        elif t is list or t is tuple:
            out += (LIST if t is list else TUPLE, len(v))
            for j, x in enumerate(v):
                tx = type(x)
                if tx in _FAST or (tx is int and MIN_INT <= x <= MAX_INT):
                    out += (VAL, x)
                else:
                    _encode(x, out, tensors, paths, seen, (path, j), depth + 1)
        else:
            _encode(v.value, out, tensors, paths, seen, path, depth + 1)
    else:
        raise TypeError(f"{_path_text(path) or 'tensor_dict'}: {t.__name__} {v!r:.60} cannot be "
                        f"broadcast ({_WHAT})")


def _enum_key(k: Any, path: tuple) -> Any:
    if isinstance(k, Enum) and type(k.value) in _SCALARS:
        return k.value
    raise TypeError(f"{_path_text(path) or 'tensor_dict'}: dict key {k!r:.60} of type "
                    f"{type(k).__name__} cannot be broadcast (keys: str, int, bool, float, None, or an "
                    "enum of those)")


def _key_of(k: Any) -> Any:
    return k.value if isinstance(k, Enum) else k


def _path_text(path: tuple) -> str:
    """``(((), "attn"), "lens"), 2)`` -> ``"attn.lens.2"`` (for labels and messages)."""
    keys = []
    while path:
        path, k = path
        keys.append(str(k))
    return ".".join(reversed(keys))


def token_path(tokens: list[Any], j: int) -> str:
    """The key path of the entry whose key or value is token ``j`` of a driver's tree (for naming
    a value the codec refused: a lone surrogate in a str). Example: tokens of ``{"a": [1, "x"]}``
    are ``[2, 1, "a", 3, 2, 0, 1, 0, "x"]``; token 8 -> ``"a.1"``."""
    def walk(at: int, path: tuple) -> tuple[int, Optional[str]]:
        tag, n = tokens[at], tokens[at + 1]
        if j in (at, at + 1):
            return at + 2, _path_text(path)
        at += 2
        if tag in (VAL, TENSOR):
            return at, None
        for i in range(n):
            sub: tuple = (path, i)
            if tag == DICT:
                sub = (path, tokens[at])
                if at == j:
                    return at, _path_text(sub)
                at += 1
            at, found = walk(at, sub)
            if found is not None:
                return at, found
        return at, None

    return walk(0, ())[1] or "tensor_dict"


# ---- a follower: (tokens, tensors) -> dict ----------------------------------------------------
def decode_tree(tokens: Any, tensors: list[torch.Tensor]) -> dict:
    """The dict the driver's :func:`encode_tree` described, its tensors at their indices.

    Everything is proven: tags, counts, keys (plain scalars), leaf values (plain scalars), tensor
    indices (each in range, every tensor used), nesting at most :data:`MAX_DEPTH`, no token left
    over. A tree that does not parse is a ``ValueError`` naming the token. Example: tokens ``[2,
    1, 7, 4, 2, 0, None, 1, 0]`` and ``[t]`` -> ``{7: (None, t)}``.
    """
    if type(tokens) is not list or len(tokens) < 2 or type(tokens[0]) is not int or tokens[0] != DICT:
        raise ValueError(f"tensor dict: the tree is not a list starting with a dict "
                         f"({type(tokens).__name__} {tokens!r:.60})")
    used = [False] * len(tensors)
    box = [0]
    try:
        out = _decode(tokens, box, tensors, used, 0)
    except IndexError:
        raise ValueError(f"tensor dict: the tree ends early ({len(tokens)} tokens)") from None
    if box[0] != len(tokens):
        raise ValueError(f"tensor dict: {len(tokens) - box[0]} tokens after the tree")
    if not all(used):
        raise ValueError(f"tensor dict: tensor {used.index(False)} of {len(tensors)} is not in the tree")
    return out


def _decode(tok: list[Any], box: list[int], tensors: list[torch.Tensor], used: list[bool],
            depth: int) -> Any:
    at = box[0]
    tag, arg = tok[at], tok[at + 1]
    box[0] = at + 2
    if type(tag) is not int:
        raise ValueError(f"tensor dict: token {at} is {type(tag).__name__} {tag!r:.40}, expected a tag")
    if tag == VAL:
        if type(arg) not in _SCALARS:
            raise ValueError(f"tensor dict: value at token {at + 1} is {type(arg).__name__}, "
                             "expected None, bool, int, float or str")
        return arg
    if tag == TENSOR:
        if type(arg) is not int or not 0 <= arg < len(tensors):
            raise ValueError(f"tensor dict: tensor index {arg!r:.40} at token {at + 1}, "
                             f"{len(tensors)} tensors sent")
        used[arg] = True
        return tensors[arg]
    if tag not in (DICT, LIST, TUPLE) or type(arg) is not int or not 0 <= arg <= len(tok):
        raise ValueError(f"tensor dict: token {at} is tag {tag!r:.40} count {arg!r:.40}")
    if depth >= MAX_DEPTH:
        raise ValueError(f"tensor dict: nested deeper than MAX_DEPTH={MAX_DEPTH} levels")
    i = box[0]  # plain leaves inline (most entries), anything else through _decode
    if tag == DICT:
        d: dict[Any, Any] = {}
        for _ in range(arg):
            k, tg, v = tok[i], tok[i + 1], tok[i + 2]
            if type(k) not in _SCALARS or k in d:
                raise ValueError(f"tensor dict: key {k!r:.40} at token {i} is not a plain "
                                 "scalar or repeats")
            if type(tg) is int and tg == VAL and type(v) in _SCALARS:
                d[k] = v
                i += 3
            else:
                box[0] = i + 1
                d[k] = _decode(tok, box, tensors, used, depth + 1)
                i = box[0]
        box[0] = i
        return d
    items = []
    for _ in range(arg):
        tg, v = tok[i], tok[i + 1]
        if type(tg) is int and tg == VAL and type(v) in _SCALARS:
            items.append(v)
            i += 2
        else:
            box[0] = i
            items.append(_decode(tok, box, tensors, used, depth + 1))
            i = box[0]
    box[0] = i
    return items if tag == LIST else tuple(items)
