"""Read Python int sequences (token ids, block tables, drafts) into one int64 numpy array.

Shared by the sequence input (``SequenceBatch.from_sequences``) and the builders; an id that is not
an int within int64 is a ``ValueError`` naming the field of the sequence that holds it
(``seqs[3].compressed_token_ids: expected ints within int64 ...``).
"""

from __future__ import annotations

import array
from itertools import chain
from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__ = ["int_array", "first_bad"]

_LIST_TYPES = frozenset((list, tuple, range))


def int_array(parts: Sequence[Any], total: int, field: Any = "seqs[i] ids") -> np.ndarray:
    """Concatenate int sequences (lists, tuples, numpy arrays or tensors) into one int64 array.

    Python lists go through ``array.array("q").fromlist`` (one C loop per list, about twice as
    fast as ``np.fromiter`` over ``itertools.chain``); other sequences through ``np.fromiter``;
    ``np.concatenate`` / ``torch.cat`` when every part already is an array / tensor.
    ``total`` is the expected length (checked). An id that is not an int within int64 is a
    ``ValueError`` naming ``field`` (``"seqs[i].token_ids"``: ``i`` becomes the offending part's
    index; or a callable mapping that index to the name).
    """
    try:
        return _int_array(parts, total)
    except (OverflowError, TypeError, ValueError) as e:
        bad = first_bad(parts)
        if callable(field):
            where = field(bad) if bad is not None else "seqs"
        else:
            where = field.replace("[i]", f"[{bad}]") if bad is not None else field
        raise ValueError(f"{where}: expected ints within int64 ({type(e).__name__}: {e})") from None


def first_bad(parts: Sequence[Any]) -> Optional[int]:
    """Index of the first part that does not convert on its own (error paths only)."""
    return next((i for i, p in enumerate(parts) if not _fits_int64(p)), None)


def _fits_int64(part: Any) -> bool:
    """Whether ``part`` alone converts (the same conversion that just failed for the batch)."""
    try:
        _int_array([part], len(part))
        return True
    except (OverflowError, TypeError, ValueError, AssertionError):
        return False


def _int_array(parts: Sequence[Any], total: int) -> np.ndarray:
    kinds = set(map(type, parts))
    if kinds == {list}:
        buf = array.array("q")
        for _ in map(buf.fromlist, parts):  # per-sequence loop inside map, C per token
            pass
        res = np.frombuffer(buf, np.int64) if len(buf) else np.zeros(0, np.int64)
    elif kinds <= _LIST_TYPES:
        res = np.fromiter(chain.from_iterable(parts), np.int64, total)
    elif kinds == {np.ndarray}:
        res = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
    elif kinds == {torch.Tensor}:
        res = torch.cat([p.reshape(-1) for p in parts]).to(torch.int64).numpy()
    else:
        res = np.fromiter((int(x) for x in chain.from_iterable(parts)), np.int64, total)
    assert len(res) == total, f"int_array: expected {total} ids, got {len(res)}"
    return res
