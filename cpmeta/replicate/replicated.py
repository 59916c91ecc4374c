"""``ReplicatedBatchState``: every CP rank keeps the same ``BatchState``; the driver sends the step.

The engines our users run (vLLM v1's persistent ``InputBatch``, SGLang's and TensorRT-LLM's
per-rank schedulers) do not broadcast built metadata: they send the scheduler's decisions and
every rank builds its own. This is that design on cpmeta's transport and frame codec::

    driver                                           every follower
    rep.add_request(...) / append_* / finish(...)    (waits in sync())
    rep.decode_batch(slots, drafts, 2)   -- each call applied to the driver's replica at once
    batch = rep.sync()  ── ONE step frame ──────────▶ batch = rep.sync()
                           (op log: runs + int64        apply the runs in order, the spec's
                            columns, ~1 KB for a         batch from the own replica; its
                            decode step of 64)           per-sequence digest == the driver's
    md = prepare_decode(batch, cfg, out=arenas)      md = prepare_decode(batch, cfg, out=arenas)

Each driver call is validated by the driver's own ``BatchState`` first: a call it refuses (bad
request, a capacity) raises there, changes nothing and is never sent, so every replica stays
unchanged by it. A step's frame ends with its batch spec: calls the driver makes after
``decode_batch`` / ``prompt_batch`` (the step's results, arriving early) are applied to the
driver's replica at once but travel with the NEXT step, so after ``sync()`` every follower's
replica stands exactly where the driver's stood when it made the batch (``rep.spec`` holds the
spec's arguments on every rank, for engines that stage from the state: ``stage_decode``). Divergence is impossible to miss: every frame carries its step number (a gap
or a replay is refused), every step the follower's batch is compared with the driver's by
per-sequence digests, and every ``check_every`` steps the ranks compare digests of their whole
replicas (``cpmeta.replicate.digest``); a mismatch is a ``RuntimeError`` naming the rank, the
step and the first differing request, after which that replica refuses every further step.
"""

from __future__ import annotations

import hashlib
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .. import envs
from ..config import MetadataConfig
from ..state import BatchState, SequenceBatch
from ..broadcast.channel import FrameChannel, resolve_src
from ..broadcast.wire import FLAG_PACKED, Frame, WireError
from .apply import ReplicaError, apply_step
from .digest import N_BANDS, batch_digest, fold, replica_digest
from .ops import BLK, CMP, SID, SVS, TOK, OpLog
from .step_frame import STEP_SCHEMA, column_dims, read_columns, step_key, write_columns

__all__ = ["ReplicatedBatchState", "StepSpec", "DEFAULT_CHECK_EVERY"]

#: steps between two whole-replica digest comparisons (a collective over the gloo group)
DEFAULT_CHECK_EVERY = 64
_NO_DIGEST = np.zeros(0, np.int64)


class ReplicatedBatchState:
    """One ``BatchState`` per rank, kept equal by sending each step's ops from the driver.

    Collective constructor: every rank of ``group`` constructs it with the same ``cfg`` and
    capacities (checked: ``ValueError`` naming the ranks). The driver (``src`` global rank, or
    ``group_src`` inside the group; default rank 0 of the group) calls ``BatchState``'s mutating
    methods and one batch spec per step on it; EVERY rank calls :meth:`sync` once per step and
    gets that step's ``SequenceBatch`` from its own replica (``None`` for a step without a spec).
    Per-rank example (2 ranks)::

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
            batch digest always runs).
        timeout, force_remote, checksum: as for ``MetadataBroadcaster``.
    """

    def __init__(self, cfg: MetadataConfig, max_seqs: int, *, group: Any = None,
                 group_src: Optional[int] = None, src: Optional[int] = None,
                 device: Optional[torch.device | str] = None, check_every: int = DEFAULT_CHECK_EVERY,
                 max_tokens: Optional[int] = None, max_blocks: Optional[int] = None,
                 max_compressed: Optional[int] = None, timeout: Optional[float] = None,
                 force_remote: Optional[bool] = None, checksum: Optional[bool] = None) -> None:
        if type(check_every) is not int or check_every < 0:
            raise ValueError(f"check_every: expected an int >= 0, got {check_every!r}")
        self.cfg = cfg
        self.group = group if group is not None else dist.group.WORLD
        self.src = resolve_src(self.group, src, group_src)
        self.rank = dist.get_rank()
        self.is_src = self.rank == self.src
        if device is None:
            nccl = "nccl" in str(dist.get_backend(self.group)).lower()
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        self.check_every = check_every
        self.state = BatchState(cfg, max_seqs, max_tokens=max_tokens, max_blocks=max_blocks,
                                max_compressed=max_compressed)
        ch_sum = envs.checksum() if checksum is None else bool(checksum)
        st = self.state
        fp = _state_fingerprint(cfg, st.max_seqs, st.max_tokens, st.max_blocks, st.max_compressed)
        self._ch = FrameChannel(self.group, self.src, STEP_SCHEMA, what="ReplicatedBatchState",
                                timeout=timeout, force_remote=force_remote, checksum=ch_sum,
                                agree={"state setting": fp, "check_every setting": check_every})
        self._key = step_key()
        self._log = OpLog()  # this step's calls, up to and with its batch spec
        self._next = OpLog()  # calls made after the spec: the next step's first ops
        self._batch: Optional[SequenceBatch] = None
        #: the last synced step's batch spec on every rank (None for a step without one)
        self.spec: Optional[StepSpec] = None
        self._pending_spec: Optional[StepSpec] = None
        self._spec_digest: Optional[np.ndarray] = None  # driver: the replica digest at spec time
        self._broken: Optional[str] = None  # why this replica refuses further steps
        self.step = 0  # steps synced so far
        self._closed = False

    # ---- the driver's calls (BatchState's mutating API + the batch spec) --------------------
    def add_request(self, req_id: Hashable, prompt_token_ids: Sequence[int], block_table: Sequence[int],
                    state_id: int, *, compressed_token_ids: Sequence[int] = (), swa_valid_start: int = 0,
                    num_computed: int = 0) -> int:
        """``BatchState.add_request`` on the driver's replica, recorded for the step (request ids:
        int or str, they travel in the frame)."""
        self._driver("add_request")
        if type(req_id) is not str and not isinstance(req_id, (int, np.integer)) or isinstance(req_id, bool):
            raise TypeError(f"request {req_id!r}: a replicated request id is an int or a str, got "
                            f"{type(req_id).__name__}")
        rid = req_id if type(req_id) is str else int(req_id)
        st = self.state
        s = st.add_request(rid, prompt_token_ids, block_table, state_id,
                           compressed_token_ids=compressed_token_ids, swa_valid_start=swa_valid_start,
                           num_computed=num_computed)
        self._rec.add(s, rid, st.token_ids[s, :st.num_tokens[s]].copy(),
                      st.block_table[s, :st.num_blocks[s]].copy(),
                      st.compressed[s, :st.num_compressed[s]].copy(), int(st.state_id[s]),
                      int(st.swa_valid_start[s]), int(st.num_computed[s]))
        return s

    def append_tokens(self, slot: int, tokens: Sequence[int]) -> None:
        self._driver("append_tokens")
        st = self.state
        n0 = int(st.num_tokens[int(slot)]) if 0 <= int(slot) < st.max_seqs else 0
        st.append_tokens(slot, tokens)
        n1 = int(st.num_tokens[slot])
        self._rec.ragged(TOK, np.array([slot], np.int64), np.array([n1 - n0], np.int64),
                         st.token_ids[slot, n0:n1].copy())

    def append_tokens_batch(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        self._driver("append_tokens_batch")
        self.state.append_tokens_batch(slots, tokens, counts)
        self._rec.ragged(TOK, np.array(slots, np.int64), np.array(counts, np.int64),
                         np.array(tokens, np.int64))

    def append_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        self._driver("append_blocks")
        self._append_one(BLK, slot, blocks, self.state.append_blocks, "block_table", "num_blocks")

    def append_compressed(self, slot: int, ids: Sequence[int]) -> None:
        self._driver("append_compressed")
        self._append_one(CMP, slot, ids, self.state.append_compressed, "compressed", "num_compressed")

    def _append_one(self, code: int, slot: int, values: Sequence[int], apply: Any, rows: str,
                    counts: str) -> None:
        st = self.state
        n0 = int(getattr(st, counts)[int(slot)]) if 0 <= int(slot) < st.max_seqs else 0
        apply(slot, values)
        n1 = int(getattr(st, counts)[slot])
        self._rec.ragged(code, np.array([slot], np.int64), np.array([n1 - n0], np.int64),
                         getattr(st, rows)[slot, n0:n1].copy())

    def set_state_id(self, slot: int, state_id: int) -> None:
        self._driver("set_state_id")
        self.state.set_state_id(slot, state_id)
        self._rec.pair(SID, int(slot), int(self.state.state_id[slot]))

    def set_swa_valid_start(self, slot: int, swa_valid_start: int) -> None:
        self._driver("set_swa_valid_start")
        self.state.set_swa_valid_start(slot, swa_valid_start)
        self._rec.pair(SVS, int(slot), int(self.state.swa_valid_start[slot]))

    def finish(self, slot: int) -> None:
        self._driver("finish")
        self.state.finish(slot)
        self._rec.finish(int(slot))

    def prompt_batch(self, slots: np.ndarray, chunk_lens: np.ndarray, *, num_placeholders: int = 0,
                     advance: bool = True) -> None:
        """The step's batch spec: ``BatchState.prompt_batch`` (made on the driver now, on every
        follower when it applies the step); :meth:`sync` returns the batch on every rank."""
        self._driver("prompt_batch")
        self._spec_free()
        slots_a, lens = np.array(slots, np.int64), np.array(chunk_lens, np.int64)
        self._batch = self.state.prompt_batch(slots_a, lens, num_placeholders=num_placeholders,
                                              advance=advance)
        self._log.batch_spec(True, slots_a, lens, _NO_DIGEST, num_placeholders, advance, -2)
        self._pending_spec = StepSpec(True, slots_a, lens, None, None, int(num_placeholders), bool(advance))
        self._at_spec()

    def decode_batch(self, slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                     num_drafts: Optional[np.ndarray | int] = None, *, num_placeholders: int = 0) -> None:
        """The step's batch spec: ``BatchState.decode_batch`` (see :meth:`prompt_batch`)."""
        self._driver("decode_batch")
        self._spec_free()
        self._batch = self.state.decode_batch(slots, draft_tokens, num_drafts,
                                              num_placeholders=num_placeholders)
        uniform = -2 if num_drafts is None else (int(num_drafts) if np.ndim(num_drafts) == 0 else -1)
        lens = np.array(num_drafts, np.int64).reshape(-1) if uniform == -1 else _NO_DIGEST
        drafts = _NO_DIGEST if draft_tokens is None else np.array(draft_tokens, np.int64).reshape(-1)
        slots_a = np.array(slots, np.int64).reshape(-1)
        self._log.batch_spec(False, slots_a, lens, drafts, num_placeholders, True, uniform)
        self._pending_spec = _decode_spec(slots_a, lens, drafts, uniform, int(num_placeholders))
        self._at_spec()

    # ---- every rank -----------------------------------------------------------------------
    def sync(self) -> Optional[SequenceBatch]:
        """Every rank, once per step: the step's ``SequenceBatch`` from this rank's replica
        (``None`` for a step without a batch spec). The driver sends the step's ops as one
        frame; followers apply them. A diverged replica is a ``RuntimeError`` naming the rank,
        the step and the first differing request (see the module docstring)."""
        if self._closed:
            raise RuntimeError("ReplicatedBatchState: sync() after close()")
        if self._broken is not None:
            raise RuntimeError(f"rank {self.rank}: replica diverged earlier ({self._broken}); "
                               "rebuild the ReplicatedBatchState")
        step = self.step + 1
        check = bool(self.check_every) and step % self.check_every == 0
        if self.is_src:
            batch = self._send(step, check)
        else:
            batch = self._receive(step)
        self.step = step
        if check:
            self._check_replicas(step)
        return batch

    def close(self) -> None:
        """Release the shared-memory ring (idempotent)."""
        if not self._closed:
            self._closed = True
            self._ch.close()

    def __enter__(self) -> "ReplicatedBatchState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    @property
    def _rec(self) -> OpLog:
        """Where the driver's next call is recorded: after the step's spec, the next step's log
        (a step's frame ends with its spec, so every replica stands where the driver stood when
        it made the batch)."""
        return self._next if self._log.spec is not None else self._log

    def _at_spec(self) -> None:
        """Driver: when the coming sync compares replicas, digest this replica NOW -- where every
        follower's will stand after applying the step (calls after the spec travel later)."""
        step = self.step + 1
        if self.check_every and step % self.check_every == 0:
            self._spec_digest = replica_digest(self.state, self._band(step))

    def _band(self, step: int) -> int:
        return (step // max(self.check_every, 1)) % N_BANDS

    def _driver(self, what: str) -> None:
        if not self.is_src:
            raise RuntimeError(f"rank {self.rank}: {what} is the driver's call (src={self.src}); "
                               "followers call only sync() and read .state")
        if self._closed:
            raise RuntimeError(f"ReplicatedBatchState: {what} after close()")

    def _spec_free(self) -> None:
        if self._log.spec is not None:
            raise ValueError("one batch spec per step: prompt_batch / decode_batch was already "
                             "called since the last sync()")

    def _send(self, step: int, check: bool) -> Optional[SequenceBatch]:
        batch, log = self._batch, self._log
        cols = log.arrays(batch_digest(batch) if batch is not None else _NO_DIGEST)
        values = [step, check, list(log.req_ids), list(log.spec or [])]
        prep = self._ch.prepare(self._key, values, column_dims(cols))

        def write(view: memoryview, addr: int, data_at: int) -> None:
            write_columns(addr + data_at, cols)

        self._ch.publish(prep, FLAG_PACKED, prep.exact, prep.region, write)
        self._log, self._next = self._next, log
        log.clear()
        self.spec, self._pending_spec, self._batch = self._pending_spec, None, None
        return batch

    def _receive(self, step: int) -> Optional[SequenceBatch]:
        def handler(frame: Frame, view: memoryview) -> tuple[dict[str, np.ndarray], list[Any]]:
            h = frame.head
            if not h.flags & FLAG_PACKED:
                raise WireError("step frame without FLAG_PACKED")
            numels, _, _ = frame.plan.check_tensors(frame.dims, True, h.tbytes, view.nbytes - h.data_at)
            return read_columns(view, h.data_at, numels, frame.dims), frame.values

        cols, (got_step, _check, req_ids, spec) = self._ch.receive(handler)
        if got_step != step:
            self._broken = f"step {got_step} arrived, step {step} expected"
            raise RuntimeError(f"rank {self.rank}: step frame {got_step} from src={self.src} where "
                               f"step {step} was expected ({'a replay' if got_step < step else 'a gap'}"
                               "); the replica refuses it")
        self.spec = _spec_of(cols, spec) if spec else None
        try:
            batch = apply_step(self.state, cols, req_ids, spec or None)
        except (ReplicaError, ValueError, IndexError) as e:
            self._broken = f"step {step}: {e}"
            raise RuntimeError(f"rank {self.rank}: step {step}: this replica cannot apply the "
                               f"driver's step (diverged): {type(e).__name__}: {e}") from None
        want = cols["batch_digest"]
        mine = batch_digest(batch) if batch is not None else _NO_DIGEST
        if not np.array_equal(mine, want):
            i = int(np.flatnonzero(mine != want)[0]) if len(mine) == len(want) else min(len(mine), len(want))
            self._broken = f"step {step}: batch differs from the driver's"
            raise RuntimeError(f"rank {self.rank}: step {step}: this replica's batch differs from "
                               f"the driver's at sequence {i} ({self._name_seq(batch, cols, i)}): "
                               "the replicas diverged")
        return batch

    def _name_seq(self, batch: Optional[SequenceBatch], cols: dict[str, np.ndarray], i: int) -> str:
        slots = cols["spec_slots"]
        if i < len(slots):
            s = int(slots[i])
            return f"request {self.state.request_of(s)!r}, slot {s}"
        return "a placeholder or a sequence only one side has"

    def _check_replicas(self, step: int) -> None:
        """Collective over the gloo group: every rank's folded replica digest; on a mismatch the
        per-slot digests name the first differing request, and EVERY rank raises."""
        ctrl = self._ch.objects.ctrl
        ranks = dist.get_process_group_ranks(ctrl)
        per_slot = self._spec_digest if self._spec_digest is not None else replica_digest(
            self.state, self._band(step))
        self._spec_digest = None
        mine = torch.tensor([fold(per_slot)], dtype=torch.int64)
        got = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        dist.all_gather(got, mine, group=ctrl)
        folded = [int(t.item()) for t in got]
        if len(set(folded)) == 1:
            return
        rows = [torch.zeros(self.state.max_seqs, dtype=torch.int64) for _ in ranks]
        dist.all_gather(rows, torch.from_numpy(per_slot), group=ctrl)
        ref = rows[ranks.index(self.src)].numpy()
        bad = [(r, int(np.flatnonzero(t.numpy() != ref)[0])) for r, t in zip(ranks, rows)
               if not np.array_equal(t.numpy(), ref)]
        where = "; ".join(f"rank {r} first differs at slot {s} (request "
                          f"{self.state.request_of(s)!r} here)" for r, s in bad)
        self._broken = f"step {step}: replica digests differ"
        raise RuntimeError(f"rank {self.rank}: step {step}: replica digests differ from the "
                           f"driver's (rank {self.src}): {where}")


class StepSpec(NamedTuple):
    """A step's batch spec as every rank knows it after ``sync()`` (``rep.spec``): the
    arguments of its ``prompt_batch`` (``chunk_lens``, ``advance``) or ``decode_batch``
    (``draft_tokens``, ``num_drafts``: one int, an array or None). An in-place decode engine
    stages from it on every rank: ``cpmeta.stage_decode(staging, rep.state, spec.slots,
    spec.draft_tokens, spec.num_drafts, num_placeholders=spec.num_placeholders)``."""

    is_prompt: bool
    slots: np.ndarray
    chunk_lens: Optional[np.ndarray]
    draft_tokens: Optional[np.ndarray]
    num_drafts: Optional[np.ndarray | int]
    num_placeholders: int
    advance: bool


def _decode_spec(slots: np.ndarray, lens: np.ndarray, drafts: np.ndarray, uniform: int,
                 n_ph: int) -> StepSpec:
    nd: Optional[np.ndarray | int] = uniform if uniform >= 0 else (lens if uniform == -1 else None)
    return StepSpec(False, slots, None, drafts if len(drafts) or nd is not None else None, nd, n_ph, True)


def _spec_of(cols: dict[str, np.ndarray], spec: list[int]) -> StepSpec:
    """A follower's :class:`StepSpec` of a received step (its spec values and columns)."""
    is_prompt, n_ph, advance, uniform = spec
    if is_prompt:
        return StepSpec(True, cols["spec_slots"], cols["spec_lens"], None, None, n_ph, bool(advance))
    return _decode_spec(cols["spec_slots"], cols["spec_lens"], cols["spec_drafts"], uniform, n_ph)


def _state_fingerprint(cfg: MetadataConfig, *caps: int) -> str:
    """16 hex digits of the config (every field; tensors by their bytes) and the capacities."""
    h = hashlib.sha256()
    for name in sorted(cfg.__dataclass_fields__):
        v = getattr(cfg, name)
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}={v!r};".encode())
    h.update(repr(caps).encode())
    return h.hexdigest()[:16]
