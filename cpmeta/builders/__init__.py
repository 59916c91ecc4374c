"""Scheduler input -> ``InputMetadata`` on the host (docs/design.md sections 3-5, 10).

Every field a builder writes is declared once, in ``InputMetadata``'s field table
(:mod:`cpmeta.fields`); ``prepare_decode``'s arena layout is generated from it, and each field is
taken from the caller's ``out=`` (None, a dict, or an :class:`~cpmeta.buffers.OutputBuffers`)
through :func:`cpmeta.buffers.alloc`. A batch comes in as a ``SequenceBatch`` or a list converted
to one (``as_sequence_batch``, ``cpmeta/state/batch.py``). Example::

    arenas = cpmeta.OutputArenas()                       # caller-owned, one arena per batch shape
    md = prepare_decode(batch, cfg, out=arenas)          # md.positions: a view of that arena

===================  ===========================================================================
module               holds
===================  ===========================================================================
``prompt``           :func:`prepare_prompt` (chunked prefill metadata)
``decode``           :func:`prepare_decode` (decode metadata, MTP drafts)
``int_ops``          int32 checks, ``loaded_compressed_len``
``common_njit``      the compiled fields prompt and decode share, their checks and error codes
``decode_njit``      the decode build's one kernel
``prompt_njit``      the compiled prompt build: fill pass (every field); its count pass (checks,
                     sizes) is ``prompt_count_njit``
``yoco``             the names of the YoCo (prefill truncation) fields
``attn_info``        :func:`compute_attn_info`, the lazy expansion to dense indices
===================  ===========================================================================
"""

from __future__ import annotations

from .attn_info import compute_attn_info
from .decode import prepare_decode
from .prompt import prepare_prompt

__all__ = ["prepare_prompt", "prepare_decode", "compute_attn_info"]
