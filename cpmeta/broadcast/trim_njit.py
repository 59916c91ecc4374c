"""The driver's one pass over a column-padded table before it is framed: how many leading
columns hold anything but the pad (``Plan.narrow``, docs/design.md section 7).

A decode step's ``block_tables`` is ``[total_q, max_num_blocks]`` (``max_model_len``'s columns)
but its rows define only ``blocks_needed`` columns, -1 after; the frame carries only the columns
up to the widest row's last defined one, and every follower puts the pad back. Worked example:
rows ``[5, 6, -1, -1]`` and ``[7, -1, -1, -1]`` with pad -1 -> 2 columns sent; a row
``[-1, -1, 9, -1]`` alone -> 3 (a pad value INSIDE a row is data: only the trailing run of pad
in every row is left out, so the follower's copy is bit-identical).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel, warmer

__all__ = ["used_columns"]


@kernel
def used_columns(a: np.ndarray, pad: int) -> int:
    """Columns of the int32 2-D ``a`` up to and including the last non-``pad`` entry of any
    row (0 when every entry is ``pad``). Each row is read from its end until its last defined
    entry, and never past the widest row found so far: one pass over the pad, nothing more."""
    rows, cols = a.shape
    used = 0
    for r in range(rows):
        c = cols - 1
        while c >= used and a[r, c] == pad:
            c -= 1
        if c + 1 > used:
            used = c + 1
            if used == cols:
                return cols
    return used


@warmer
def _warm() -> None:
    """The kernel once, on an int32 table."""
    used_columns(np.array([[1, -1], [-1, -1]], np.int32), -1)
