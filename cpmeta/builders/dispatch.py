"""``prepare``: one entry point for a step's metadata, prompt or decode as the batch says.

A :class:`~cpmeta.state.batch.SequenceBatch` knows whether it is a prompt chunk batch or a decode
batch (``is_prompt``); a mixed step (``ReplicatedBatchState.sync()`` returns a tuple then: the
prompt chunks and the decode batch) gives one metadata per batch. A list of ``SequenceMetadata``
does not say which it is (a one-token prompt chunk and a decode row hold the same fields), so it
needs ``is_prompt=``. Example::

    md = cpmeta.prepare(state.decode_batch(slots), cfg, out=arenas)        # decode
    mds = cpmeta.prepare(rep.sync(), cfg)                                   # one per batch of the step
    md = cpmeta.prepare([SequenceMetadata(...)], cfg, is_prompt=True)      # a list: say which
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union, overload

import numpy as np

from ..config import MetadataConfig
from ..metadata import InputMetadata
from ..sequence import SequenceMetadata
from ..state import SequenceBatch
from .decode import prepare_decode
from .prompt import prepare_prompt

__all__ = ["prepare"]


@overload
def prepare(batch: SequenceBatch, cfg: MetadataConfig, *, is_prompt: Optional[bool] = None,
            out: Any = None) -> InputMetadata: ...


@overload
def prepare(batch: tuple[SequenceBatch, ...], cfg: MetadataConfig, *, is_prompt: Optional[bool] = None,
            out: Any = None) -> tuple[InputMetadata, ...]: ...


@overload
def prepare(batch: Sequence[SequenceMetadata], cfg: MetadataConfig, *, is_prompt: Optional[bool] = None,
            out: Any = None) -> InputMetadata: ...


def prepare(batch: Union[SequenceBatch, tuple[SequenceBatch, ...], Sequence[SequenceMetadata]],
            cfg: MetadataConfig, *, is_prompt: Optional[bool] = None,
            out: Any = None) -> Union[InputMetadata, tuple[InputMetadata, ...]]:
    """Build the step's ``InputMetadata`` with :func:`prepare_prompt` or :func:`prepare_decode`.

    Args:
        batch: a ``SequenceBatch`` (its ``is_prompt`` picks the builder), a tuple of them (a mixed
            step; one metadata each, in order), or a list of ``SequenceMetadata`` (then
            ``is_prompt`` is required).
        cfg: the engine's ``MetadataConfig``.
        is_prompt: for a list; for a batch it must agree with ``batch.is_prompt`` when given.
        out: passed to the builder (``OutputArenas``, a dict of buffers, or None); with a tuple of
            batches the same ``out`` serves each (an ``OutputArenas`` keeps one arena per shape).

    Raises ``ValueError`` for a list without ``is_prompt`` or a batch whose kind disagrees, and
    whatever the builder raises for bad input (naming ``seqs[i].field``).
    """
    if isinstance(batch, tuple) and batch and all(isinstance(b, SequenceBatch) for b in batch):
        return tuple(_one(b, cfg, is_prompt, out) for b in batch)
    return _one(batch, cfg, is_prompt, out)


def _one(batch: Any, cfg: MetadataConfig, is_prompt: Optional[bool], out: Any) -> InputMetadata:
    if is_prompt is not None and not isinstance(is_prompt, (bool, np.bool_)):
        raise TypeError(f"is_prompt: expected a bool or None, got {is_prompt!r}")
    if isinstance(batch, SequenceBatch):
        if is_prompt is not None and bool(is_prompt) != batch.is_prompt:
            raise ValueError(f"is_prompt={is_prompt} but the SequenceBatch is a "
                             f"{'prompt' if batch.is_prompt else 'decode'} batch")
        kind = batch.is_prompt
    elif is_prompt is None:
        raise ValueError("is_prompt: required for a list of SequenceMetadata (a one-token prompt chunk "
                         "and a decode row hold the same fields); a SequenceBatch says which it is")
    else:
        kind = bool(is_prompt)
    return prepare_prompt(batch, cfg, out=out) if kind else prepare_decode(batch, cfg, out=out)
