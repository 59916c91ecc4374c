"""Value checks of the state room's inputs: the ids of a batch's token windows and the scalar /
id arguments of ``BatchState``'s methods.

Every check here is vectorized (one or two numpy reductions on the data the caller already
holds) and only locates the offender when it fails, so the message names the sequence (or the
request) and the field: ``seqs[3].draft_tokens: expected ids in [0, 2**31 - 1] ...`` or
``request 'a': prompt_token_ids: expected ids >= 0, got -5 at index 2``.

Token ids must be ``>= 0`` (a negative id would index ``ngram_lookup`` from its end and reach the
model as an embedding row that does not exist) and fit int32 (``input_ids`` and
``ngram_token_ids`` are int32).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..constants import INT32_MAX
from .state_njit import MAX_PLACEHOLDERS

__all__ = ["check_window_ids", "ids_in_int32", "check_int_arg", "as_int_array", "bad_id", "check_placeholders",
           "is_draft_count", "check_bool", "int64_flat", "MAX_PLACEHOLDERS"]

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
_I64 = np.dtype(np.int64)  # (numpy's native int64 dtype is one object: an ``is`` test)


def ids_in_int32(ids: np.ndarray) -> bool:
    """Every entry of the signed-int array ``ids`` is in ``[0, 2**31 - 1]`` (True when empty), in
    ONE reduction: the bitwise or of such ids is such an id too (``>> 31`` is 0), while a
    negative id sets the sign and an id ``>= 2**31`` a bit at or above 31. Example: ``[5, 3]`` ->
    ``5 | 3 = 7``, ``7 >> 31 = 0``: True; ``[5, -1]`` -> ``-1 >> 31 = -1``: False."""
    return not len(ids) or not int(np.bitwise_or.reduce(ids) >> 31)


def check_window_ids(tokens: np.ndarray, token_offsets: np.ndarray, seqlen_q: np.ndarray, seqlen_k: np.ndarray,
                     lookback: int, is_prompt: bool) -> None:
    """Raise ``ValueError`` naming ``seqs[i].token_ids`` (or ``.draft_tokens``) when an id of the
    token windows of a ``SequenceBatch`` is outside ``[0, 2**31 - 1]``; the windows are those of
    its layout (positions ``[lo, seqlen_k)``, ``lo = max(0, q_start - lookback)``; decode: the
    positions after ``q_start`` are the drafts).

    Locating the id (error path only): flat index ``f`` lies in the window ``i`` with
    ``token_offsets[i] <= f < token_offsets[i + 1]``, at absolute position ``lo_i + f -
    token_offsets[i]``. Example: decode, offsets ``[0, 2, 5]``, seqlen_q ``[1, 3]``, seqlen_k
    ``[6, 9]``, lookback 0, ``tokens[4] = -1`` -> sequence 1 (``2 <= 4 < 5``), ``q_start = 6``,
    position ``6 + 4 - 2 = 8`` > q_start: ``seqs[1].draft_tokens`` entry ``8 - 6 - 1 = 1``.
    """
    if ids_in_int32(tokens):
        return
    f = int(np.argmax((tokens < 0) | (tokens > INT32_MAX)))
    i = int(np.searchsorted(token_offsets, f, side="right")) - 1
    q_start = int(seqlen_k[i] - seqlen_q[i])
    pos = max(q_start - lookback, 0) + f - int(token_offsets[i])
    if not is_prompt and pos > q_start:
        field, at = "draft_tokens", pos - q_start - 1
    else:
        field, at = "token_ids", pos
    raise ValueError(f"seqs[{i}].{field}: expected ids in [0, 2**31 - 1] (input_ids and ngram_token_ids "
                     f"are int32), got {int(tokens[f])} at index {at}")


def _who(req: Any) -> str:
    return "" if req is None else f"request {req!r}: "


def check_placeholders(n: object) -> None:
    """``num_placeholders``: an int in ``[0, MAX_PLACEHOLDERS]`` (numpy integers count, bools do
    not), else ``TypeError`` / ``ValueError`` naming it."""
    if type(n) is not int or not 0 <= n <= MAX_PLACEHOLDERS:
        check_int_arg("num_placeholders", n, lo=0)
        if n > MAX_PLACEHOLDERS:  # type: ignore[operator]  # an int by now
            raise ValueError(f"num_placeholders: expected <= {MAX_PLACEHOLDERS} (rows padding one batch), "
                             f"got {n!r}")


def check_bool(name: str, v: object) -> None:
    """``v`` is a bool (a numpy bool counts), else ``TypeError`` naming it (``"no"`` is not False)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {v!r}")


def is_draft_count(num_drafts: Any) -> bool:
    """``num_drafts`` given as ONE count for every request of the step (an int, not a bool)
    rather than one count per request."""
    return isinstance(num_drafts, (int, np.integer)) and not isinstance(num_drafts, (bool, np.bool_))


def check_int_arg(name: str, v: Any, req: Any = None, lo: Optional[int] = None) -> None:
    """``v`` is an int (a numpy integer counts, a bool does not) within int64, and ``>= lo`` when
    given, else ``TypeError`` / ``ValueError("request 'a': state_id: expected ...")``; ``req``
    ``None`` names no request (``"num_placeholders: ..."``)."""
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise TypeError(f"{_who(req)}{name}: expected an int, got {v!r}")
    if not INT64_MIN <= v <= INT64_MAX:
        raise ValueError(f"{_who(req)}{name}: expected an int within int64, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{_who(req)}{name}: expected >= {lo}, got {v!r}")


def int64_flat(*arrays: Any) -> bool:
    """Each of ``arrays`` is already what :func:`as_int_array` returns unchanged: a flat,
    contiguous, writable int64 numpy array (the kernels' one argument type)."""
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype is not _I64 or a.ndim != 1:
            return False
        f = a.flags
        if not (f.c_contiguous and f.writeable):
            return False
    return True


def as_int_array(name: str, values: Any, req: Any = None) -> np.ndarray:
    """``values`` (a sequence of ints, a numpy int array, an int tensor) as a flat, contiguous,
    writable int64 array (no copy for such an array), else ``TypeError`` / ``ValueError`` naming the field (and the
    request, ``req`` not ``None``): floats, bools and ints beyond int64 are refused, never cast
    (``np.asarray([1.5], np.int64)`` would truncate to 1). An empty input of any type is fine."""
    if type(values) is np.ndarray and values.dtype is _I64 and values.ndim == 1:  # the common case, first
        f = values.flags
        if f.c_contiguous and f.writeable:
            return values
    try:
        a = np.asarray(values)
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError(f"{_who(req)}{name}: expected ints within int64 ({e})") from None
    if a.dtype != np.int64:
        if a.size == 0:
            return np.zeros(0, np.int64)
        if a.dtype.kind not in "iu":
            raise TypeError(f"{_who(req)}{name}: expected ints, got {a.dtype} values")
        if a.dtype == np.uint64 and int(a.max()) > INT64_MAX:
            raise ValueError(f"{_who(req)}{name}: expected ints within int64, got {int(a.max())}")
        a = a.astype(np.int64)
    if a.ndim != 1:
        a = a.reshape(-1)
    # one array type for the kernels (each other layout would compile its own specialization)
    return a if a.flags.c_contiguous and a.flags.writeable else a.copy()


def bad_id(name: str, ids: np.ndarray, req: Any) -> None:
    """Raise the ``ValueError`` naming the first negative id of ``ids`` (of request ``req``) and
    its index; nothing when there is none. Error path only. Example: ``[8, -5]`` ->
    ``request 'a': tokens: expected ids >= 0, got -5 at index 1``."""
    bad = np.flatnonzero(ids < 0)
    if bad.size:
        f = int(bad[0])
        raise ValueError(f"{_who(req)}{name}: expected ids >= 0, got {int(ids[f])} at index {f}")
