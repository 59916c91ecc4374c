"""Array-level input (DESIGN section 13): one step's sequences as arrays, and the engine's state.

==================  ===========================================================================
module              holds
==================  ===========================================================================
``batch``           :class:`SequenceBatch`: a step's scheduled sequences as numpy arrays
``store``           ``StateStore``: the preallocated per-request arrays other rooms may read
                    (``token_ids``, ``block_table``, ``num_blocks``, ...; read-only to them)
``requests``        ``RequestBook``: ``add_request``, ``add_requests_batch``, ``finish``,
                    ``finish_batch`` (slots in and out)
``batch_state``     :class:`BatchState`: requests added once, deltas per step, the step's batch
``state_njit``      the compiled kernels: a step's appends, its gather, the staging's vouching
``requests_njit``   ``add_rows``: a step's new requests in one compiled call
``checks``          value checks: token-window ids, ``BatchState``'s scalar and id arguments
==================  ===========================================================================

This room owns its arrays: no module outside it reads or writes a private attribute of a state
or a batch (``tests/test_house_rules.py`` checks it). It
imports only ``cpmeta``'s base modules (config, sequence, constants, jit); the builders and the
GPU room import it, never the reverse.
"""

from __future__ import annotations

from .batch import SequenceBatch
from .batch_state import BatchState, VouchedStep

__all__ = ["SequenceBatch", "BatchState", "VouchedStep"]
