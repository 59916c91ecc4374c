"""The step frame: one scheduler step as a schema'd dataclass on the common frame codec.

``StepFrame`` is what ``ReplicatedBatchState.sync()`` sends: the step number, whether the
replicas compare digests after it, the added requests' ids, the batch spec, and every op-log
column of :mod:`cpmeta.replicate.ops` as an int64 tensor (raw little-endian bytes in the frame,
strictly parsed like every frame: ``cpmeta.broadcast.wire``). Its layout never changes (every
column is sent, empty when unused), so after the first step a frame carries only the layout id,
the four values and the column lengths.

Driver and followers move the columns as numpy arrays: :func:`write_columns` copies them into
the frame (one ``memmove`` each, no torch tensor per step), :func:`read_columns` cuts one
private copy of the frame's region into int64 views (:class:`Columns`, which the compiled replay
of :mod:`cpmeta.replicate.replay_njit` walks as one buffer).
"""

from __future__ import annotations

from itertools import accumulate
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ..broadcast.schema import Schema
from .ops import COLUMNS, WIDE

__all__ = ["StepFrame", "STEP_SCHEMA", "step_key", "column_dims", "write_columns", "read_columns",
           "flat_columns", "Columns"]


class _Col:
    """Field metadata of a step-frame column: int64, rank 1 or 2 (the schema pins both)."""

    def __init__(self, ndim: int) -> None:
        self.dtype, self.ndim = torch.int64, ndim


def _col(name: str) -> Any:
    return field(default=None, metadata={"cpmeta": _Col(2 if name in WIDE else 1)})


@dataclass(slots=True)
class StepFrame:
    """One step of a ``ReplicatedBatchState`` (columns: see :mod:`cpmeta.replicate.ops`)."""

    step: Optional[int] = None  # 1, 2, ...: followers refuse a gap or a replay
    check: Optional[bool] = None  # compare replica digests after this step
    req_ids: Optional[list[int | str]] = None  # ids of the requests added, in order
    spec: Optional[list[int]] = None  # [is_prompt, num_placeholders, advance, drafts] or []
    runs: Optional[torch.Tensor] = _col("runs")  # [r, 2] int64 (op code, entries)
    add_meta: Optional[torch.Tensor] = _col("add_meta")  # [a, 7] int64
    add_tokens: Optional[torch.Tensor] = _col("add_tokens")  # [sum #tokens] int64
    add_blocks: Optional[torch.Tensor] = _col("add_blocks")  # [sum #blocks] int64
    add_comp: Optional[torch.Tensor] = _col("add_comp")  # [sum #compressed] int64
    tok_slots: Optional[torch.Tensor] = _col("tok_slots")  # [t] int64
    tok_counts: Optional[torch.Tensor] = _col("tok_counts")  # [t] int64
    tok_flat: Optional[torch.Tensor] = _col("tok_flat")  # [sum tok_counts] int64
    blk_slots: Optional[torch.Tensor] = _col("blk_slots")
    blk_counts: Optional[torch.Tensor] = _col("blk_counts")
    blk_flat: Optional[torch.Tensor] = _col("blk_flat")
    cmp_slots: Optional[torch.Tensor] = _col("cmp_slots")
    cmp_counts: Optional[torch.Tensor] = _col("cmp_counts")
    cmp_flat: Optional[torch.Tensor] = _col("cmp_flat")
    sid_pairs: Optional[torch.Tensor] = _col("sid_pairs")  # [s, 2] int64 (slot, state id)
    svs_pairs: Optional[torch.Tensor] = _col("svs_pairs")  # [s, 2] int64 (slot, valid start)
    fin_slots: Optional[torch.Tensor] = _col("fin_slots")  # [f] int64
    spec_slots: Optional[torch.Tensor] = _col("spec_slots")  # [n] int64
    spec_lens: Optional[torch.Tensor] = _col("spec_lens")  # [n] or [0] int64
    spec_drafts: Optional[torch.Tensor] = _col("spec_drafts")  # [sum drafts] int64
    batch_digest: Optional[torch.Tensor] = _col("batch_digest")  # [rows, 4] int64 (digest.batch_check)


STEP_SCHEMA: Schema = Schema.of(StepFrame)
assert tuple(f for f in STEP_SCHEMA.field_names[4:]) == COLUMNS, "StepFrame columns = ops.COLUMNS"


def step_key() -> tuple:
    """The layout key of every step frame (the one layout: every column int64, field order)."""
    from ..broadcast.collect import collect

    empty = {c: torch.zeros((0, WIDE[c]) if c in WIDE else 0, dtype=torch.int64) for c in COLUMNS}
    key, _, _ = collect(StepFrame(step=1, check=False, req_ids=[], spec=[], **empty), STEP_SCHEMA)
    return key


def column_dims(cols: list[np.ndarray]) -> tuple[int, ...]:
    """The flat dims of the columns (``[r, 2]`` then ``[a, 7]`` ... -> ``(r, 2, a, 7, ...)``)."""
    return tuple(d for c in cols for d in c.shape)


def write_columns(view: memoryview, at: int, cols: list[np.ndarray]) -> None:
    """The columns back to back at ``view[at:]`` (one int64 run: the frame's region layout), in
    ONE ``np.concatenate`` into the slot."""
    flat = [c.ravel() for c in cols]
    n = sum(map(len, flat))
    if n:
        np.concatenate(flat, out=np.frombuffer(view, np.int64, n, at))


def read_columns(view: memoryview, at: int, numels: list[int], dims: tuple[int, ...]) -> Columns:
    """One private int64 copy of the region at ``view[at:]`` cut into the named columns."""
    buf = np.empty(sum(numels), np.int64)
    if len(buf):
        buf.view(np.uint8)[:] = np.frombuffer(view, np.uint8, len(buf) * 8, at)
    return _cut(buf, numels, dims)


def flat_columns(cols: list[np.ndarray]) -> Columns:
    """The driver's own columns (``OpLog.columns``) as one int64 buffer, as a follower holds them."""
    buf = np.concatenate([c.ravel() for c in cols]) if cols else np.zeros(0, np.int64)
    return _cut(buf, [c.size for c in cols], column_dims(cols))


class Columns(NamedTuple):
    """A step's columns: ``named`` views (``[k, w]`` for the wide ones) of ONE int64 ``buf``,
    column ``i`` at ``buf[starts[i]:starts[i + 1]]`` (what the compiled replay walks)."""

    named: dict[str, np.ndarray]
    buf: np.ndarray
    starts: np.ndarray


def _cut(buf: np.ndarray, numels: list[int], dims: tuple[int, ...]) -> Columns:
    bounds = [0, *accumulate(numels)]
    out, d = {}, 0
    for name, a, b in zip(COLUMNS, bounds, bounds[1:]):
        col = buf[a:b]
        if name in WIDE:
            col = col.reshape(dims[d], dims[d + 1])
            d += 2
        else:
            d += 1
        out[name] = col
    return Columns(out, buf, np.array(bounds, np.int64))
