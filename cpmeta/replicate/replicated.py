"""``ReplicatedBatchState``: every CP rank keeps the same ``BatchState``; the driver sends the step.

The engines our users run (vLLM v1's persistent ``InputBatch``, SGLang's and TensorRT-LLM's
per-rank schedulers) do not broadcast built metadata: they send the scheduler's decisions and
every rank builds its own. This is that design on cpmeta's transport and frame codec::

    driver                                           every follower
    rep.add_request(...) / append_* / finish(...)    (waits in sync())
    rep.decode_batch(slots, drafts, 2)   -- each call applied to the driver's replica at once
    batch = rep.sync()  ── ONE step frame ──────────▶ batch = rep.sync()
                           (op log: runs + int64        apply the runs in order, the spec's
                            columns + the batch's        batch from the own replica; its
                            digests, ~4 KB for a         per-sequence digests == the driver's
                            decode step of 64)
    md = prepare_decode(batch, cfg, out=arenas)      md = prepare_decode(batch, cfg, out=arenas)

Each driver call is validated by the driver's own ``BatchState`` first: a call it refuses (bad
request, a capacity) raises there, changes nothing and is never sent, so every replica stays
unchanged by it. A step's frame ends with its batch spec: calls the driver makes after
``decode_batch`` / ``prompt_batch`` (the step's results, arriving early) are applied to the
driver's replica at once but travel with the NEXT step, so after ``sync()`` every follower's
replica stands exactly where the driver's stood when it made the batch (``rep.spec`` holds the
spec's arguments on every rank, for engines that stage from the state: ``stage_decode``).

Divergence is impossible to miss: every frame carries its step number (a gap or a replay is
refused); every step, before ``sync()`` returns, each follower compares digests of everything
its batch's build reads (per sequence: lengths and ids, the token window, the block table, the
Engram window) with the driver's, so a replica that would build different metadata is refused
AT that step; and every ``check_every`` steps the ranks compare digests of their whole replicas
(``cpmeta.replicate.digest``: made and exchanged while the engine runs, the verdict at the next
``sync()`` or ``close()``). A mismatch is a ``RuntimeError`` naming the rank, the step and the
first differing request, after which that replica refuses every further step. While a
same-host follower spins for its next step it warms (:meth:`ReplicatedBatchState.warm`).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import envs
from ..config import MetadataConfig
from ..buffers import OutputArenas
from ..builders.decode_sink import DecodeSink
from ..builders.prompt import prepare_prompt
from ..metadata import InputMetadata
from ..state import BatchState, SequenceBatch
from ..broadcast.channel import FrameChannel, resolve_src
from ..transport import background, start_gather
from ..transport.envs import ENV_TIMEOUT, check_flags, resolve_device, resolve_group
from .apply import ReplicaError, apply_step, batches_of, one_or_many, warm_replay
from .digest import batch_check, digest_call, first_difference, slots_differ, where_differs
from .ops import COLUMNS, Columns
from .recorder import Recorder, StepSpec, specs_of
from .step_frame import STEP_SCHEMA, StepReader, fixed_head, receive_step, send_step, state_fingerprint, step_key
from .step_read_njit import F_DONE, OWN

__all__ = ["ReplicatedBatchState", "StepSpec", "DEFAULT_CHECK_EVERY"]

#: steps between two whole-replica digest comparisons (a collective through the rendezvous store,
#: its verdict at the sync after the check's step)
DEFAULT_CHECK_EVERY = 64
_NO_CHECK = np.zeros((0, 4), np.int64)  # the batch check of a step without a batch spec
_DIGEST = COLUMNS.index("batch_digest")
#: a step frame's region above which the warm only enters the replay (a prompt step's copy costs
#: the spinning core more than it saves the next step)
WARM_BULK_BYTES = 64 << 10


class ReplicatedBatchState(Recorder):
    """One ``BatchState`` per rank, kept equal by sending each step's ops from the driver.

    Collective constructor: every rank of ``group`` constructs it with the same ``cfg`` and
    capacities (checked: ``ValueError`` naming the ranks). The driver (``src`` global rank, or
    ``group_src`` inside the group; default rank 0 of the group) calls ``BatchState``'s mutating
    methods (plus ``append_blocks_batch`` / ``append_compressed_batch``) and the step's batch
    spec on it (``prompt_batch`` / ``decode_batch``; a mixed step may make one of each); EVERY
    rank calls :meth:`sync` once per step and gets that step's ``SequenceBatch`` from its own
    replica (``None`` without a spec, a tuple in call order with several). Per-rank example::

        rep = ReplicatedBatchState(cfg, max_seqs=256, group=cp_group, group_src=0)  # both
        if cp_rank == 0:                                        # the driver only
            s = rep.add_request("a", prompt, block_table=[7, 3], state_id=0)
            rep.prompt_batch([s], [512])
        batch = rep.sync()                                      # both: the same batch
        md = cpmeta.prepare_prompt(batch, cfg)                  # both: bit-identical

    Args:
        cfg: the config every replica uses (the same on every rank).
        max_seqs, max_tokens, max_blocks, max_compressed: ``BatchState``'s capacities.
        group, src, group_src: the CP group and its driver, as for ``MetadataBroadcaster``.
        device: where this rank's metadata is built (``self.device``; default the current CUDA
            device for an NCCL group, else CPU): the replica itself is host arrays.
        check_every: steps between whole-replica digest comparisons (0 = never; the per-step
            batch digest always runs); a check's digests are exchanged while the engine runs
            and its verdict raised at the next :meth:`sync` on every rank, naming the check's step.
        defer_apply: the driver only RECORDS its calls (``add_request``'s slot predicted from
            the state's hand-out order), sends the step at :meth:`sync`, then applies it to its
            own replica like every follower, in parallel with them (vLLM's order: its workers
            update their ``InputBatch`` after the broadcast). Faster end to end (the driver's
            apply leaves the critical path), but a call the state refuses for what only its
            arrays show (a chunk past the prompt, a capacity, a decode still in prefill, a held
            state id; the rest is refused at the call) surfaces at ``sync()`` on EVERY rank and
            leaves every replica refusing further steps (rebuild), and the
            per-step batch check of step ``k`` is compared at step ``k + 1``. Use it when the
            scheduler vouches for its calls; the default validates each call on the driver first.
        timeout, force_remote, checksum: as for ``MetadataBroadcaster``.
    """

    def __init__(self, cfg: MetadataConfig, max_seqs: int, *, group: Any = None,
                 group_src: Optional[int] = None, src: Optional[int] = None,
                 device: Optional[torch.device | str] = None, check_every: int = DEFAULT_CHECK_EVERY,
                 max_tokens: Optional[int] = None, max_blocks: Optional[int] = None,
                 max_compressed: Optional[int] = None, timeout: Any = ENV_TIMEOUT,
                 force_remote: Optional[bool] = None, checksum: Optional[bool] = None,
                 defer_apply: bool = False) -> None:
        if type(check_every) is not int or check_every < 0:
            raise ValueError(f"check_every: expected an int >= 0, got {check_every!r}")
        check_flags(checksum=checksum, force_remote=force_remote, defer_apply=defer_apply)
        self.cfg = cfg
        self.group = resolve_group(group)
        self.src = resolve_src(self.group, src, group_src)
        self.rank = dist.get_rank()
        self.is_src = self.rank == self.src
        self.device, self.check_every = resolve_device(device, self.group), check_every
        st = self.state = BatchState(cfg, max_seqs, max_tokens=max_tokens, max_blocks=max_blocks,
                                     max_compressed=max_compressed)
        ch_sum = envs.checksum() if checksum is None else bool(checksum)
        fp = state_fingerprint(cfg, st.max_seqs, st.max_tokens, st.max_blocks, st.max_compressed)
        self._ch = FrameChannel(self.group, self.src, STEP_SCHEMA, what="ReplicatedBatchState",
                                timeout=timeout, force_remote=force_remote, checksum=ch_sum,
                                agree={"state setting": fp, "check_every setting": check_every,
                                       "defer_apply setting": bool(defer_apply)})
        self._key = step_key()
        self._init_recorder(bool(defer_apply), self.is_src)
        # defer_apply: this rank's batch check of the last step; a follower's: the batches it is of, until made
        self._prev_check, self._check_due = _NO_CHECK, None  # type: np.ndarray, Any
        self._specs: Optional[tuple[StepSpec, ...]] = ()  # a follower's made when read (~20 us) from
        self._specs_at = self._prev_specs_at = None  # type: Any  # its frame's (columns, spec words)
        self._spec_slots = self._digesting = None  # type: Any  # the per-slot digests at spec time; until made
        self._checking: Any = None  # (step, per-slot digests, the gather under way) of the last check
        self._broken: Optional[str] = None  # why this replica refuses further steps
        self.step, self._closed = 0, False  # steps synced so far; close() called
        self._warm_from: Any = None  # (head bytes, step, its whole region, columns, sink, [frame])
        self._sink: Optional[DecodeSink] = None  # sync_metadata's, for its last ``out``
        self._got: list[Any] = []  # the last step's batches (``apply.Gathered``: made when read)
        self._warming = self._ch.warm_with(self.warm)  # a same-host follower warms while it spins
        fpb = STEP_SCHEMA.fingerprint.encode()  # the compiled read's, and the compiled writer's first header bytes
        self._reader, self._fixed = None if ch_sum else StepReader(fpb), fixed_head(fpb)
        if self._reader is not None:  # a defer_apply follower makes its step check later (_receive)
            self._reader.fused.digest = self.is_src or not self._defer
        self._written = 0  # driver: frames that writer wrote whole (the codec wrote the others)
        if check_every:  # the helper thread and the digest kernels' load (~8 ms) now, not at the first check
            self._digest(0)

    # ---- every rank -----------------------------------------------------------------------
    @property
    def specs(self) -> tuple[StepSpec, ...]:
        """The last synced step's batch specs on every rank, in call order (:attr:`spec`: the first)."""
        if self._specs is None:
            self._specs = specs_of(*self._specs_at)
        return self._specs

    @property
    def batches(self) -> tuple[SequenceBatch, ...]:
        """The last synced step's batches on every rank, in call order (as :meth:`sync` returns)."""
        self._got[:] = batches_of(self._got)  # in place: the warm's reference sees them made
        return tuple(self._got)

    @property
    def spec(self) -> Optional[StepSpec]:
        """The last synced step's batch spec (``None`` without one; the first of several)."""
        return self.specs[0] if self.specs else None

    def begin_step(self) -> None:
        """Driver: announce the next :meth:`sync` before recording the step (optional): same-host
        followers parked in ``sync()`` wake now and spin (as ``MetadataBroadcaster.begin_step``)."""
        if self.is_src and not self._closed:
            self._ch.announce()

    def sync(self) -> Optional[SequenceBatch | tuple[SequenceBatch, ...]]:
        """Every rank, once per step: the step's ``SequenceBatch`` from this rank's replica
        (``None`` for a step without a batch spec, a tuple for a step with several). The driver
        sends the step's ops as one frame; followers apply them. A diverged replica is a
        ``RuntimeError`` naming the rank, the step and what differs (see the module docstring)."""
        return one_or_many(self._sync(None)[0])

    def sync_metadata(self, out: OutputArenas) -> Optional[InputMetadata | tuple[InputMetadata, ...]]:
        """:meth:`sync`, then each batch's ``prepare_prompt`` / ``prepare_decode`` with ``out=out``,
        bit for bit (the same reuse contract: a result is valid until the next build of its shape
        into ``out``); a follower (and a ``defer_apply`` driver) replays a decode step of a shape
        built before and builds it in ONE compiled call (``cpmeta.builders.decode_sink.DecodeSink``).
        ``None`` / one / a tuple as :meth:`sync`; the batches are :attr:`batches`. Every rank::

            arenas = cpmeta.OutputArenas()
            md = rep.sync_metadata(arenas)   # == prepare_decode(rep.sync(), cfg, out=arenas)
        """
        if not isinstance(out, OutputArenas):
            raise TypeError(f"out: expected a cpmeta.OutputArenas, got {type(out).__name__}")
        sink = self._sink
        if sink is None or sink.arenas is not out:
            sink = self._sink = DecodeSink(self.cfg, out)
        batches, mds = self._sync(sink)  # a batch the replay did not build: the builders
        if len(mds) == 1 and mds[0] is not None:  # (a decode step the replay's call built)
            return mds[0]
        return one_or_many([md if md is not None else prepare_prompt(b, self.cfg, out=out) if b.is_prompt
                            else sink.fill(b) for b, md in zip(batches, mds)])

    def _sync(self, sink: Optional[DecodeSink]) -> tuple[list[Any], list[Any]]:
        """One step: its batches (``apply.Gathered`` where the replay built one) and the metadata it built."""
        if self._closed:
            raise RuntimeError("ReplicatedBatchState: sync() after close()")
        if self._broken is not None:
            raise RuntimeError(f"rank {self.rank}: replica diverged earlier ({self._broken}); "
                               "rebuild the ReplicatedBatchState")
        if self._checking is not None:  # the last replica check's verdict (every rank, here)
            self._check_verdict(*self._checking)
        step = self.step + 1
        check = bool(self.check_every) and step % self.check_every == 0
        batches, mds = self._send(step, check, sink) if self.is_src else self._receive(step, sink)
        self.step = step
        self._got = batches
        if check:
            self._start_check(step)
        return batches, mds

    def warm(self) -> None:
        """Follower: the last step's frame read again by the compiled read, read-only (into the
        reader's other buffer, the replay entered at the end of its runs: nothing applied), so the
        step lands on warm code; the ring calls it every ~100 us while this rank spins
        (``CPMETA_WARM``). After a frame over ``WARM_BULK_BYTES`` (a prompt step's) only the
        replay's entry; nothing before the compiled read holds the frame's layout."""
        got = self._warm_from
        if got is None or self._reader is None or self._reader.lid < 0:
            return
        head, step, region, cols, sink, whole = got
        if region.nbytes > WARM_BULK_BYTES:  # its copy would evict more than it warms
            warm_replay(self.state, cols, sink)
            return
        if not whole:  # the frame's bytes, put together once per step (writable: a ring slot's kernels)
            whole.append(memoryview(bytearray(head + region.tobytes())))
        self._reader.read(whole[0], step, None if sink is None else (self.state, sink), dry=True)

    def close(self) -> None:
        """Release the shared-memory ring (idempotent), after the verdict of a check no sync took."""
        if not self._closed:
            self._closed, self._fast = True, False
            try:
                if self._checking is not None and self._broken is None:
                    self._check_verdict(*self._checking)
            finally:
                self._ch.close()

    def __enter__(self) -> "ReplicatedBatchState":
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self._checking = self._checking if kind is None else None  # an error on its way: no waiting
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    def _at_spec(self) -> None:
        """Driver: when the coming sync compares replicas, digest this replica as it stands NOW --
        where every follower's will after applying the step (calls after the spec travel later)."""
        step = self.step + 1
        if self.check_every and step % self.check_every == 0 and not self._defer:
            self._spec_slots = self._digest(step)

    def _digest(self, step: int) -> tuple[np.ndarray, Any]:
        """``(per_slot, wait)``: this replica's digests for check step ``step``, begun on the helper
        thread; the default driver's next call (:meth:`_driver`) or another rank's verdict waits."""
        per_slot, digest = digest_call(self.state, step // self.check_every)
        made = per_slot, background(self._ch.objects, digest)
        self._digesting = made if self.is_src and not self._defer else None
        return made

    def _driver(self, what: str) -> None:
        if self._digesting is not None:  # a check's digest reads the replica this call may change
            wait, self._digesting = self._digesting[1], None
            wait()
        if not self.is_src:
            raise RuntimeError(f"rank {self.rank}: {what} is the driver's call (src={self.src}); "
                               "followers call only sync() and read .state")
        if self._closed:
            raise RuntimeError(f"ReplicatedBatchState: {what} after close()")

    def _send(self, step: int, check: bool, sink: Optional[DecodeSink]) -> tuple[list[Any], list[Any]]:
        log = self._log
        # default: the specs' batches, made at the calls; defer_apply: made by the apply below
        batches = [] if self._defer else [b for b in self._batches if b is not None]
        digest = self._prev_check if self._defer else batch_check(batches)
        self._written += send_step(self._ch, self._key, log, digest, step, check, self._fixed)
        mds: list[Any] = [None] * len(batches)
        if self._defer:  # sent: now the driver's replica takes the step, as every follower's
            cols, specs = log.pack(digest), log.specs  # (its specs made from them when read, as a follower's)
            self._specs, self._specs_at = None, (cols, specs)
            batches, mds = self._apply_deferred(step, check, cols, list(log.req_ids), specs, sink, log.words)
        else:
            self._specs = tuple(self._pending)  # (made at the calls)
        self._log, self._next = self._next, log  # calls after the last spec open the next step
        log.clear()
        self._pending, self._batches = [], []
        return batches, mds

    def _apply_deferred(self, step: int, check: bool, cols: Columns, req_ids: list[Any], spec: list[int],
                        sink: Optional[DecodeSink], words: np.ndarray) -> tuple[list[Any], list[Any]]:
        """``defer_apply`` driver, after sending: its own replica applies the step (``words``:
        ``spec`` as the log's int64); a call the state refuses is the driver's ``ValueError``
        (every follower refuses it the same way)."""
        try:  # a decode step of the last shape: replayed and built in one call, as on a follower
            fused = None if sink is None or self._reader is None else \
                self._reader.fused.apply(cols, words, self.state, sink)
            batches, self._prev_check, mds = apply_step(self.state, cols, req_ids, spec, sink, lazy=True, fused=fused)
        except (ReplicaError, ValueError, IndexError) as e:
            self._broken = f"step {step}: a call the state refused: {e}"
            raise ValueError(f"ReplicatedBatchState (defer_apply): step {step}: the state refused a "
                             f"call already sent: {e}; every replica refuses further steps "
                             "(rebuild the ReplicatedBatchState)") from None
        return batches, mds

    def _receive(self, step: int, sink: Optional[DecodeSink]) -> tuple[list[Any], list[Any]]:
        fuse = None
        if self._check_due is not None:  # defer_apply: the last step's check, before this replay reuses its buffers
            self._prev_check, self._check_due = batch_check(batches_of(self._check_due)), None
        if sink is not None:  # aimed at the last shape: the compiled read builds a decode step of it
            sink.refresh()
            fuse = (self.state, sink)
        cols, (got_step, _check, req_ids, spec), saved, fused = receive_step(
            self._ch, self._reader, self._warming, fuse, self._prev_check if self._defer else OWN)
        if got_step != step:
            self._broken = f"step {got_step} arrived, step {step} expected"
            raise RuntimeError(f"rank {self.rank}: step frame {got_step} from src={self.src} where "
                               f"step {step} was expected ({'a replay' if got_step < step else 'a gap'}"
                               "); the replica refuses it")
        self._specs, self._specs_at = None, (cols, spec)
        try:
            batches, mine, mds = apply_step(self.state, cols, req_ids, spec, sink, lazy=True, fused=fused,
                                            digest=not self._defer)
        except (ReplicaError, ValueError, IndexError) as e:
            self._broken = f"step {step}: {e}"
            why = ("the driver's replica refused it too (defer_apply: a bad call)" if self._defer
                   else "diverged")
            raise RuntimeError(f"rank {self.rank}: step {step}: this replica cannot apply the "
                               f"driver's step ({why}): {type(e).__name__}: {e}") from None
        reader = self._reader  # (a step the compiled read built: it compared the checks)
        checked = fused is not None and fused[0] == F_DONE and reader is not None and reader.checked
        self._compare(mine, None if checked else cols.col(_DIGEST), step)
        self._check_due = list(batches) if self._defer else None  # defer_apply: checked when the next sync begins
        if saved:
            self._warm_from = (saved[0], step, saved[1], cols, sink, [])
        return batches, mds

    def _compare(self, check: np.ndarray, theirs: Optional[np.ndarray], step: int) -> None:
        """Follower: this replica's batch check (``check``, as the replay wrote it; ``defer_apply``:
        the last step's) against the frame's ``batch_digest`` (``theirs``; None: the compiled read
        found them equal); a difference breaks the replica and raises, naming this rank, the
        step, the request and what differs."""
        if self._defer:  # (this step's check: made when the next sync begins)
            mine, at, specs_at = self._prev_check, step - 1, self._prev_specs_at
            self._prev_specs_at = self._specs_at
        else:
            mine, at, specs_at = check, step, self._specs_at
        if theirs is None:
            return
        diff = first_difference(mine, theirs)
        if diff is None:
            return
        where = where_differs(diff, specs_of(*specs_at) if specs_at else (), self.state)
        self._broken = f"step {at}: batch differs from the driver's"
        raise RuntimeError(f"rank {self.rank}: step {at}: this replica's batch differs from the driver's "
                           f"(rank {self.src}) at {where}; the replicas diverged, this replica refuses "
                           "further steps")

    def _start_check(self, step: int) -> None:
        """Every rank, at a check step: this replica's per-slot digests (the default driver's as of
        the step's spec, :meth:`_digest`) folded into one int and gathered from every rank on the
        helper thread (``transport.start_gather``: the rendezvous store, bounded by the timeout)."""
        per_slot, value = self._spec_slots or self._digest(step)
        self._spec_slots = None
        self._checking = (step, per_slot, start_gather(self._ch.objects, f"replica-check-{step}", value))

    def _check_verdict(self, step: int, per_slot: np.ndarray, gathering: Any) -> None:
        """Collective (every rank at the sync after check step ``step``): every rank's replica
        digest (an absent rank named); on a mismatch EVERY rank raises, naming the first
        differing request (``digest.slots_differ``: every rank is alive, it just reported)."""
        self._checking = None
        try:  # bounded by the timeout; a rank that never reports, or is seen gone, is named
            got = gathering()
        except (TimeoutError, ConnectionError) as e:  # (transport's PeerError: a ConnectionError)
            self._broken = f"step {step}: replica check: {e}"
            raise type(e)(f"ReplicatedBatchState rank {self.rank}: step {step}: replica check: {e}") from None
        if len(set(got.values())) == 1:
            return
        where = slots_differ(per_slot, self._ch.objects.ctrl, self.src, self.state)
        self._broken = f"step {step}: replica digests differ"
        raise RuntimeError(f"rank {self.rank}: step {step}: replica digests differ from the "
                           f"driver's (rank {self.src}): {where}")
