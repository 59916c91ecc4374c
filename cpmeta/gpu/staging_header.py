"""Word slots of the decode staging buffer and the host scalars of one staged batch.

The numbering the layout (:mod:`cpmeta.gpu.staging_layout`, where the whole layout is drawn), its
writers and the kernels share: ``view[H_TOTAL_Q]`` is the staged ``total_q``, row ``F_SEQLEN_K``
of the ``[SEQ_FIELDS, n_seq]`` per-sequence block holds ``seqlen_k``. Example: a batch of 2
sequences has its per-sequence block at ``view[H_OFF_SEQ value : + 7 * 2]``, row ``F_STATE`` = 4.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "HEADER_FIXED", "SEQ_FIELDS", "StagedDecode",
    "H_N_SEQ", "H_TOTAL_Q", "H_TOTAL_K", "H_OFF_SEQ", "H_OFF_IDS", "H_OFF_BT", "H_OFF_NGV", "H_OFF_NGB",
    "F_SEQLEN_Q", "F_SEQLEN_K", "F_CU_Q_INCL", "F_CU_K_INCL", "F_STATE", "F_PLACEHOLDER", "F_BT_OFFSET",
]

#: header slots (the ratio words follow at ``HEADER_FIXED``)
H_N_SEQ, H_TOTAL_Q, H_TOTAL_K, H_OFF_SEQ, H_OFF_IDS, H_OFF_BT, H_OFF_NGV, H_OFF_NGB = range(8)
HEADER_FIXED = 8
#: rows of the per-sequence block
F_SEQLEN_Q, F_SEQLEN_K, F_CU_Q_INCL, F_CU_K_INCL, F_STATE, F_PLACEHOLDER, F_BT_OFFSET = range(7)
SEQ_FIELDS = 7


class StagedDecode(NamedTuple):
    """Host-side scalars of one staged batch (the buffer itself holds the arrays).

    ``used``: int32 elements of the staging buffer the batch occupies. A named tuple (made once per
    step on the hot path: ~4x cheaper to build than a frozen dataclass).
    """

    num_seqs: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    used: int
    max_blocks: int = 0  # block-table columns the widest sequence defines (max nb_s)
