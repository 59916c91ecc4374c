"""The staged-decode message as a schema'd dataclass on the common frame codec.

``StagedDecodeBroadcaster`` sends, per decode step, the host staging buffer's used prefix
(``[used]`` int32, layout: ``cpmeta.gpu.decode_staging``) and the host scalars every rank needs to
upload it and run the kernels -- or, when the driver refused the batch, the refusal's message
(the followers raise it too). Both are :class:`StagedFrame` s on ``cpmeta.broadcast.channel``'s
``FrameChannel``: the same header, schema fingerprint, layout ids and strict parsing as every
other cpmeta frame (no message format of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..broadcast.collect import collect
from ..broadcast.schema import Schema
from .decode_staging import StagedDecode

__all__ = ["StagedFrame", "STAGED_SCHEMA", "STAGED_DECODE_VERSION", "staged_key", "error_key",
           "staged_values", "staged_of"]

#: Version of the staged-decode frame (part of its schema fingerprint).
STAGED_DECODE_VERSION = 2


class _Staging:
    dtype, ndim = torch.int32, 1  # the staging prefix: 1-D int32 (the schema pins both)


@dataclass(slots=True)
class StagedFrame:
    """One staged decode step (or the driver's refusal of it)."""

    num_seqs: Optional[int] = None
    total_q: Optional[int] = None
    total_k: Optional[int] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    used: Optional[int] = None  # int32 elements of the staging prefix
    max_blocks: Optional[int] = None
    error: Optional[str] = None  # the driver refused the batch: why
    staging: Optional[torch.Tensor] = field(default=None, metadata={"cpmeta": _Staging()})  # [used] int32


STAGED_SCHEMA: Schema = Schema.of(StagedFrame, int_low=0, version=STAGED_DECODE_VERSION)
_SCALARS = ("num_seqs", "total_q", "total_k", "max_seqlen_q", "max_seqlen_k", "used", "max_blocks")


def staged_key() -> tuple:
    """Layout key of a staged step (the staging tensor + the seven scalars)."""
    return collect(StagedFrame(0, 0, 0, 0, 0, 0, 0, staging=torch.zeros(0, dtype=torch.int32)),
                   STAGED_SCHEMA)[0]


def error_key() -> tuple:
    """Layout key of a refusal (the message only)."""
    return collect(StagedFrame(error=""), STAGED_SCHEMA)[0]


def staged_values(s: StagedDecode) -> list[int]:
    return [s.num_seqs, s.total_q, s.total_k, s.max_seqlen_q, s.max_seqlen_k, s.used, s.max_blocks]


def staged_of(values: list[Any]) -> StagedDecode:
    """The ``StagedDecode`` of a received staged step's values (layout order = field order)."""
    return StagedDecode(*values)
