"""The decode builder's sink for a compiled caller: ``prepare_decode`` into a kept arena, in ONE call.

A replicated rank's replay (``cpmeta.replicate``) gathers a decode batch and fills its arena in the
same compiled call; :class:`DecodeSink` aims that call at the arena of the shape last built, and
builds (``prepare_decode``) what the call did not fill.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..buffers import OutputBuffers
from ..cache import BoundedCache
from ..config import MetadataConfig
from ..metadata import InputMetadata
from ..state.batch import SequenceBatch
from .common_njit import ngram_table
from .decode import _I64, _Shape, _Target, _metadata, _plan, prepare_decode
from .decode_njit import decode_fill_if, decode_shape

__all__ = ["DecodeSink"]


class DecodeSink:
    """``prepare_decode(batch, cfg, out=arenas)`` for a compiled caller that gathers a decode batch
    and fills its arena in the SAME call (``cpmeta.replicate``: a follower's replay and its
    build, one call per step): :attr:`args` are :func:`~.decode_njit.decode_fill_if`'s
    trailing arguments aimed at the arena of the last batch shape, which the caller's kernel
    fills when the batch has that shape; :meth:`result` is then the metadata, bit for bit what
    ``prepare_decode`` returns into the same arena. A batch of another shape (or one the kernel
    did not fill) goes through :meth:`build`: ``prepare_decode`` itself, its named errors
    included, after which the sink aims at that shape -- or, given the coming batch's
    ``total_q`` and sequence count (:meth:`refresh`), at the last shape built with those (a batch
    size that comes and goes keeps its arena). Example::

        sink = DecodeSink(cfg, arenas)
        ... kernel(..., *sink.refresh()) ...        # fills when the shape is the last one
        md = sink.result()
        md = md if md is not None else sink.build(batch)
    """

    __slots__ = ("cfg", "arenas", "args", "filled", "_plan", "_tg", "_shape", "_shapes", "_want", "_code")

    def __init__(self, cfg: MetadataConfig, arenas: OutputBuffers) -> None:
        self.cfg, self.arenas, self._plan = cfg, arenas, _plan(cfg)
        self._tg: Optional[_Target] = None
        self._shape: Optional[_Shape] = None
        self._shapes: BoundedCache[tuple[int, int], _Shape] = BoundedCache(16)  # (total_q, n_seq) -> last built
        self._want = np.full(3, -1, np.int64)  # the aimed arena's (total_q, n_seq, width): -1 until aimed
        self._code = np.full(1, -1, np.int64)  # the caller's kernel: decode_fill_if's return (-1: not filled)
        self.args: tuple = ()
        self.filled = 0  #: batches the caller's kernel built (:meth:`result` returned their metadata)
        self._aim(None)

    def refresh(self, total_q: int = -1, n_seq: int = -1) -> tuple:
        """:attr:`args` for this step: aimed at the last shape :meth:`build` made with this
        ``total_q`` and ``n_seq`` (the coming batch's, when the caller knows them), else at the
        last one; its arena as ``arenas`` holds it now (kept in use there; a new one when
        ``arenas`` dropped it)."""
        self._code[0] = -1
        shape = self._shapes.get((total_q, n_seq)) or self._shape
        if shape is not None:
            a = self.arenas.arena(shape.layout)
            if self._tg is None or a is not self._tg.arena:
                self._shape = shape
                self._aim(self._plan.target(a, shape))
            self._want[:] = shape.key
        return self.args

    def aimed(self, total_q: int, n_seq: int) -> bool:
        """Whether :attr:`args` aim at an arena of ``total_q`` rows and ``n_seq`` sequences."""
        return self._tg is not None and int(self._want[0]) == total_q and int(self._want[1]) == n_seq

    def result(self) -> Optional[InputMetadata]:
        """The metadata the caller's kernel filled this step, else ``None`` (call :meth:`build`)."""
        tg = self._tg
        if tg is None or self._code[0] != 0:
            return None
        self.filled += 1
        t, n, _ = self._want.tolist()
        return _metadata(tg, n, t, tg.info)

    def build(self, batch: SequenceBatch) -> InputMetadata:
        """``prepare_decode(batch, cfg, out=arenas)``; later steps aim at this batch's shape."""
        md = prepare_decode(batch, self.cfg, out=self.arenas)
        assert md.block_tables is not None and md.total_q is not None  # every decode layout has them
        shape = self._shape = self._plan.shape(self.cfg, md.total_q, len(batch), int(md.block_tables.shape[1]))
        self._shapes.put(shape.key[:2], shape)
        self._aim(self._plan.target(self.arenas.arena(shape.layout), shape))
        return md

    def fill(self, batch: SequenceBatch) -> InputMetadata:
        """:meth:`build` of a decode batch vouched for this config with int64 arrays (one a
        ``BatchState`` made): ONE kernel call into the arena of the last shape built with the
        batch's rows and sequences when the batch has that shape; else :meth:`build` (its named
        errors included)."""
        if self._tg is not None and not batch.is_prompt and batch.vouch_for(self.cfg) is not None:
            arrays = (batch.seqlen_q, batch.seqlen_k, batch.state_id, batch.is_placeholder, batch.tokens,
                      batch.token_offsets, batch.compressed, batch.compressed_offsets, batch.block_tables,
                      batch.block_table_offsets)
            if all(a.dtype == _I64 for i, a in enumerate(arrays) if i != 3):
                t, _, _ = decode_shape(batch.seqlen_q, len(batch.tokens), batch.block_table_offsets, batch.lookback,
                                       self.cfg.max_num_blocks)
                self.refresh(t, len(batch))
                self._code[0] = decode_fill_if(*arrays, batch.lookback, *self.args[:7])
                md = self.result()
                if md is not None:
                    return md
        return self.build(batch)

    def _aim(self, tg: Optional[_Target]) -> None:
        self._tg = tg
        p = self._plan
        if tg is None:
            self.args = (p.consts, ngram_table(self.cfg), _NO_RAW, _NO_OFFSETS, self._want, _NO_ERR, _NO_INFO,
                         self._code)
            return
        assert self._shape is not None
        self.args = (p.consts, ngram_table(self.cfg), tg.raw, self._shape.offsets, self._want, tg.err, tg.info,
                     self._code)


_NO_RAW, _NO_OFFSETS = np.zeros(0, np.uint8), np.zeros(1, np.int64)  # a sink not aimed yet: no arena
_NO_OFFSETS.flags.writeable = False  # as field_offsets' (one compiled signature)
_NO_ERR, _NO_INFO = np.zeros(4, np.int64), np.zeros(2, np.int64)
