"""The schema of a plain ``dict[str, Tensor | value]`` (``cpmeta.broadcast_tensor_dict``).

Its keys are the paths; a layout fixes which keys hold tensors (with their dtypes and ranks) and
the driver's key order, and every value is checked per frame to be a plain value
(:class:`~cpmeta.broadcast.value_check.PlainValueCheck`). Example: ``{"input_ids": t,
"num_seqs": 3, "lens": (1, 2)}`` -> tensor path ``input_ids``, value paths ``num_seqs``, ``lens``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

from .value_check import LayoutError, PlainValueCheck
from .schema import MAX_LAYOUT_PATHS

__all__ = ["DictSchema", "check_dict_key"]

_DICT_KEY_MAX = 256


class DictSchema:
    """The schema of a plain ``dict[str, Tensor | value]`` (``cpmeta.broadcast_tensor_dict``).

    Keys are the paths (1-256 printable ASCII characters without ``;`` or ``,``); a layout
    fixes which keys hold tensors, their dtypes and ranks, and the driver's key order; every
    value is a plain value (:data:`PLAIN_TYPES`, containers nested at most 8 deep), checked per
    frame. ``None`` is a value here (the key is kept). Example: ``{"input_ids": t, "num_seqs":
    3, "lens": (1, 2)}`` -> tensor path ``input_ids``, value paths ``num_seqs``, ``lens``.
    """

    name = "dict"
    dict_keys = "dict"
    fingerprint = hashlib.sha256(b"v1|cpmeta.tensor_dict").hexdigest()[:16]

    def check_layout(self, tensor_paths: list[list[str]], value_paths: list[str]
                     ) -> tuple[list[list[tuple[str, Optional[str]]]], list[tuple[str, Optional[str]]]]:
        n = sum(map(len, tensor_paths)) + len(value_paths)
        if n > MAX_LAYOUT_PATHS:
            raise LayoutError(f"layout has {n} paths, more than MAX_LAYOUT_PATHS={MAX_LAYOUT_PATHS}")
        seen: set[str] = set()
        for p in [p for ps in tensor_paths for p in ps] + value_paths:
            check_dict_key(p)
            if p in seen:
                raise LayoutError(f"{p}: key appears twice in the layout")
            seen.add(p)
        return [[(p, None) for p in ps] for ps in tensor_paths], [(p, None) for p in value_paths]

    def check_tensors(self, targets: Any, dtypes: Any, ndims: Any) -> None:
        return None

    def fixed_dims(self, targets: Any, ndims: Any) -> list[tuple[int, int, str]]:
        return []

    def value_check(self, targets: list[tuple[str, Optional[str]]]) -> "PlainValueCheck":
        return PlainValueCheck([p for p, _ in targets])


def check_dict_key(key: Any) -> None:
    """Refuse a tensor-dict key that is not 1-256 printable ASCII characters without ``;``/``,``."""
    if not (type(key) is str and 0 < len(key) <= _DICT_KEY_MAX and key.isascii() and key.isprintable()
            and ";" not in key and "," not in key):
        raise LayoutError(f"key {key!r:.80}: expected a str of 1-{_DICT_KEY_MAX} printable ASCII "
                          "characters without ';' or ','")
