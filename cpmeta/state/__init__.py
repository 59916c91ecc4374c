"""Array-level input (DESIGN section 13): one step's sequences as arrays, and the engine's state.

==================  ===========================================================================
module              holds
==================  ===========================================================================
``batch``           :class:`SequenceBatch`: a step's scheduled sequences as numpy arrays
``store``           ``StateStore``: the preallocated per-request arrays and the public read-only
                    views other rooms may read (``block_rows32``, ``last_tokens32``, ...)
``batch_state``     :class:`BatchState`: requests added once, deltas per step, the step's batch
``gather``          the general gather of a step (prompt chunks, look-back, placeholders)
``decode_fast``     the common decode step in ~15 numpy calls, and the vouching both decode fast
                    paths share (``BatchState.vouch_decode``)
``vouched``         the named constructors of the batches a state vouches for (``Vouch``: read
                    by the builders through ``SequenceBatch.vouch_for``), ``StateDecodeBatch``
``checks``          value checks: token-window ids, ``BatchState``'s scalar and id arguments
==================  ===========================================================================

This room owns its arrays: no module outside it reads or writes a private attribute of a state
or a batch (``tests/test_house_rules.py`` checks it). It
imports only ``cpmeta``'s base modules (config, sequence, constants); the builders and the GPU
room import it, never the reverse.
"""

from __future__ import annotations

from .batch import SequenceBatch
from .batch_state import BatchState
from .decode_fast import VouchedStep

__all__ = ["SequenceBatch", "BatchState", "VouchedStep"]
