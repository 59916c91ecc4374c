"""YoCo prefill truncation: the fields of its two views of one prompt metadata (docs/design.md section 10).

Consumer layers see only the last ``k = cfg.yoco_keep_tokens`` tokens of the whole prompt, yet each
kept row must compute exactly what it would compute without truncation. Per sequence ``s``::

    data_len = len(token_ids)            # the WHOLE prompt (not just what is cached)
    rect_lo  = max(0, data_len - k)      # first position consumer layers keep
    chunk    = [q_start, q_start + q_len),  q_start = seqlen_k - seqlen_q,  q_len = seqlen_q

One visibility rule serves both modes (:func:`~cpmeta.builders.prompt_njit.pivot_rows`): row ``j`` at ``pos =
q_start + j`` sees SWA keys from ``abs_lo = clamp(max(pos - W + 1, rect_lo, swa_valid_start), 0,
pos + 1)`` to ``pos``, written as the section-4 pivots ``(P0, P1, P2, P3)``.

- ``mask`` mode keeps every row and only narrows visibility: ``yoco_mask_swa_index_pivots``;
  :func:`~cpmeta.cp.yoco_views.get_mask_view` swaps them in.
- ``compact`` mode drops the rows before the rectangle (keeping at least the last row of each
  chunk): ``clip_prefix = clamp(data_len - k - q_start, 0, q_len - 1)``, kept local rows
  ``[clip_prefix, q_len)``. The ``yoco_consumer_*`` fields hold the kept rows;
  :func:`~cpmeta.cp.yoco_views.get_consumer_view` swaps them in.

Worked example (``W = 4``, ``k = 6``, one sequence with a 10-token prompt, this chunk ``q_start = 2,
q_len = 6``, so rows at positions 2..7; ``rect_lo = 4``)::

    pos               2  3  4  5  6  7
    clip_prefix = clamp(10 - 6 - 2, 0, 5) = 2   -> kept rows j = 2..5 (positions 4..7)
    abs_lo (mask)     3  4  4  4  4  4    (max(pos - 3, 4) clamped to pos + 1 for pos 2, 3)
    visible keys      -  -  4  4..5  4..6  4..7

Compact + CP (compact FIRST, then mirror; :func:`~cpmeta.cp.yoco_cp.mirror_yoco`, called by
``prepare_for_mirror_cp``): the consumer rows are zigzag-mirrored on their own compact layout
(``prepare_cp_mirror(yoco_consumer_cu_seqlens_q, ORIGINAL cu_seqlens_k, ...)``), and
``yoco_cp_contrib_index`` / ``yoco_cp_boundary_index`` move the kept rows from the full-mirror
layout to the compact-mirror layout with one all-gather::

    all_gather(full_mirror_rows[yoco_cp_contrib_index])[yoco_cp_boundary_index] == compact_rows

Views are shallow copies (``md.replace``): replaced fields are swapped in, derived fields cleared,
every other field is the SAME object; nothing is ever written through a view.

``prepare_prompt`` builds the fields (its compiled fill, :mod:`cpmeta.builders.prompt_njit`); this
module names them (from the field table); the views live in :mod:`cpmeta.cp.yoco_views`, the CP
indices in :mod:`cpmeta.cp.yoco_cp`.
"""

from __future__ import annotations

from ..fields import MIRROR, YOCO_COMPACT, YOCO_MASK, fields_with
from ..metadata import FIELDS

__all__ = ["YOCO_MASK_FIELDS", "YOCO_COMPACT_FIELDS", "YOCO_CP_FIELDS"]

#: Field filled by ``prepare_prompt`` in mask mode (from the field table: ``yoco_mask_swa_index_pivots``).
YOCO_MASK_FIELDS: tuple[str, ...] = fields_with(FIELDS, YOCO_MASK)

#: Fields filled by ``prepare_prompt`` in compact mode (from the field table: the nine
#: ``yoco_consumer_*`` fields of docs/design.md section 10, ``yoco_consumer_cu_seqlens_q`` ... ``_kv_swa_full_index_pivots``).
YOCO_COMPACT_FIELDS: tuple[str, ...] = fields_with(FIELDS, YOCO_COMPACT)

#: Fields added by ``prepare_for_mirror_cp`` (through :func:`~cpmeta.cp.yoco_cp.mirror_yoco`) on compact metadata
#: (from the field table: ``yoco_consumer_cp_mirror_len``, ``yoco_consumer_cp_contrib_pad_len``,
#: ``yoco_cp_contrib_index``, ``yoco_cp_boundary_index``).
YOCO_CP_FIELDS: tuple[str, ...] = fields_with(FIELDS, YOCO_COMPACT, MIRROR)
