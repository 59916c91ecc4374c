"""Scheduler input -> ``InputMetadata`` on the host (DESIGN sections 3-5, 10).

===================  ===========================================================================
module               holds
===================  ===========================================================================
``prompt``           :func:`prepare_prompt` (chunked prefill metadata)
``decode``           :func:`prepare_decode` (decode metadata, MTP drafts)
``extract``          ``SequenceBatch`` (``cpmeta/state/batch.py``; a list converts to it) -> ``BatchArrays``
``arrays``           ``BatchArrays`` and the integer helpers every builder uses
``common``           the fields prompt and decode share, int32 checks, compressed-KV slots
``ngram``            Engram look-back ids (``ngram_token_ids``)
``load_plan``        SWA and paged compressed-KV load segments
``swa_pivots``       the one SWA visibility rule (pivots P0..P3)
``yoco``             the YoCo (prefill truncation) fields
``attn_info``        :func:`compute_attn_info`, the lazy expansion to dense indices
===================  ===========================================================================
"""

from __future__ import annotations

from .attn_info import compute_attn_info
from .decode import prepare_decode
from .prompt import prepare_prompt

__all__ = ["prepare_prompt", "prepare_decode", "compute_attn_info"]
