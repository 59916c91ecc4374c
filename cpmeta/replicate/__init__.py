"""Replicate the step, not the metadata: every CP rank keeps the same ``BatchState`` (docs/design.md section 15).

==================  ==============================================================================
module              holds
==================  ==============================================================================
``replicated``      :class:`ReplicatedBatchState`: the driver's ``BatchState`` calls recorded and
                    sent as ONE step frame per ``sync()``; followers apply it to their replica
``ops``             the op log: runs of calls in order, their preallocated int64 columns
``step_frame``      ``StepFrame``, the op log as a schema'd dataclass on the common frame codec
                    (``cpmeta.broadcast.wire``); columns in and out of the frame as numpy
``apply``           a follower replays a step's runs on its replica; the spec's batch
``digest``          per-step batch digests and periodic whole-replica digests (divergence named)
``digest_njit``     the batch digests' kernel: one 64-bit digest per sequence and part
==================  ==============================================================================
"""

from __future__ import annotations

from .replicated import DEFAULT_CHECK_EVERY, ReplicatedBatchState

__all__ = ["ReplicatedBatchState", "DEFAULT_CHECK_EVERY"]
