"""``prepare_prompt_cp``: one CP rank's zigzag share of prompt metadata, built for that rank.

In the replicated design (``cpmeta.ReplicatedBatchState``) every rank builds its own prompt
metadata; what it reads is ``prepare_for_mirror_cp(prepare_prompt(batch, cfg), r, p)``. Most of
that object is FULL-order and must be built whole on every rank: the per-sequence fields
(prefix sums, load plans, block tables) and the per-row fields every rank reads for every row --
KV write slots (each rank writes the keys it owns, whatever row produced them), the compressed-KV
write rows, ``input_ids`` and ``query_indices`` (the rows are gathered later by
``mirror_cp_index``), the SWA pivots and compressed-KV offsets (expanded after the mirror, on the
full layout, then gathered: docs/design.md section 5). The fields the mirror GATHERS are this rank's rows only:
``positions``, ``valid_token_mask``, ``gate_force_random_cp``, ``ks`` / ``ke`` (recomputed per
mirror row) and ``ngram_token_ids`` -- and the Engram look-back is the one costly field among
them (about half of a seed-config prompt build: docs/replicate.md), so this function computes
it for this rank's rows only instead of for every row and then gathering
(``builders.common_njit.ngram_of_rows``: the builders' own per-row fill, one compiled call).
Everything else is ``prepare_for_mirror_cp``'s own work: the result equals it field for field.
Example: 8 x 4096 prompt rows, CP 4: the look-back of 8192 rows instead of 32768.
"""

from __future__ import annotations

import numpy as np
import torch

from ..builders.common_njit import ngram_of_rows, ngram_table, raise_common
from ..state.batch import BatchInput, as_sequence_batch
from ..builders.prompt import prompt_fields
from ..jit import error_slot
from ..config import MetadataConfig
from ..metadata import InputMetadata
from .mirror import prepare_for_mirror_cp

__all__ = ["prepare_prompt_cp"]


def prepare_prompt_cp(seqs: BatchInput, cfg: MetadataConfig, cp_rank: int, cp_size: int) -> InputMetadata:
    """Rank ``cp_rank``'s share of the prompt metadata of ``seqs`` (a list of
    ``SequenceMetadata`` or a prompt ``SequenceBatch``): equal, field for field, to
    ``prepare_for_mirror_cp(prepare_prompt(seqs, cfg), cp_rank, cp_size)``, with the Engram
    look-back built for this rank's rows only (see the module docstring)."""
    sb = as_sequence_batch(seqs, cfg, is_prompt=True)
    ngram = cfg.max_ngram_size > 0
    mine = prepare_for_mirror_cp(InputMetadata(**prompt_fields(sb, cfg, ngram=not ngram)), cp_rank, cp_size)
    if ngram:
        assert mine.mirror_cp_index is not None
        rows = mine.mirror_cp_index.cpu().numpy().astype(np.int64)
        out, err = np.empty((len(rows), cfg.max_ngram_size), np.int32), error_slot()
        img = cfg.image_token_id
        i64 = [a.astype(np.int64, copy=False) for a in (
            sb.seqlen_q, sb.seqlen_k, sb.tokens, sb.token_offsets, sb.compressed, sb.compressed_offsets)]
        if ngram_of_rows(i64[0], i64[1], i64[2], i64[3], i64[4], i64[5], rows, cfg.ngram_pad_token,
                         -1 if img is None else img, img is not None, ngram_table(cfg), cfg.ngram_lookup is not None,
                         out, err) or err[0]:
            raise_common(err, cfg)
        mine.ngram_token_ids = torch.from_numpy(out)
    return mine
