"""``MetadataBroadcaster``: every rank of a CP group gets the driver's metadata object.

One step, on every rank of ``group``::

    driver (src)                                    follower (parked in broadcast(None))
    [begin_step(): parked followers wake, spin]
    collect by path -> layout key, tensors, values
    layout id (the layout itself only when new)
    ONE frame (cpmeta.broadcast.wire), written straight into the ring slot:
      header | layout? | values | shapes | tensors ── shm ring (same host) ──▶ check header once
                                                    ── gloo bytes (others) ─▶ copy tensors out
    tensors of CUDA metadata above CPMETA_PACKED_MAX_BYTES:                  views (one split per
      the frame's tensor region as ONE broadcast (NCCL) ──────────────────▶  dtype run)
                                                                             Plan.assemble
The object is ``InputMetadata`` by default, or any dataclass the schema can classify
(``schema=``; ``cpmeta.broadcast.schema``). The frame carries a version and the schema's
fingerprint; a follower whose class differs raises instead of misreading. Aliasing is kept: two
paths holding the same tensor object (``positions_cp`` is ``positions`` before a mirror) are sent
once and are the same tensor object on the receiver. The follower's half of a step (frame ->
object) is the mixin ``cpmeta.broadcast.follower.FollowerSide``.
"""

from __future__ import annotations

import logging
import operator
from functools import partial
from time import perf_counter
from typing import Any, Optional

import torch
import torch.distributed as dist

from cpmeta.transport.coalesce import tensor_memoryview
from cpmeta.transport.envs import ENV_TIMEOUT, check_flags, resolve_device, resolve_group

from .. import envs
from ..metadata import InputMetadata
from . import wire
from .channel import FrameChannel, Prepared, resolve_src
from .collect import collect, collect_dict, not_dense, value_failure
from .follower import FollowerSide
from .metrics import BroadcastMetrics, BroadcastStats
from .outputs import all_cpu, check_out, copy_to_out, copy_views
from .persistent import PersistentArenas, depth_of
from .dict_schema import DictSchema
from .schema import INPUT_METADATA, SCHEMA_FINGERPRINT, Schema
from .wire import FLAG_PACKED, WireError

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION"]

logger = logging.getLogger(__name__)

MESSAGE_VERSION = wire.MESSAGE_VERSION
_IS_CUDA = operator.attrgetter("is_cuda")


class MetadataBroadcaster(FollowerSide):
    """Broadcast a metadata object from one driver rank to every rank of ``group``.

    Collective: every rank of ``group`` constructs it (hostnames are exchanged once) and calls
    :meth:`broadcast` the same number of times. Per-rank example with 2 ranks::

        b = MetadataBroadcaster()                    # rank 0 and rank 1
        b.begin_step()                               # rank 0 (optional: before it builds)
        md = b.broadcast(prepare_decode(seqs, cfg))  # rank 0 (src)
        md = b.broadcast(None)                       # rank 1
        b.close()                                    # both

    With a ``DeviceMesh``, name the driver inside the group (torch.distributed's convention)::

        b = MetadataBroadcaster(group=mesh.get_group("cp"), group_src=0)

    An engine's own metadata class (any dataclass of tensors, dicts of tensors and plain
    values; an unclassifiable field is a ``TypeError`` here, naming it)::

        b = MetadataBroadcaster(group=cp_group, group_src=0, schema=FlashAttnMetadata)

    Args:
        group: a torch.distributed process group (default WORLD); NCCL or gloo.
        src: GLOBAL rank of the driver (default 0 when ``group_src`` is not given).
        device: where received tensors live (default: current CUDA device for NCCL, else CPU).
        group_src: rank of the driver INSIDE ``group`` (instead of ``src``; both is an error).
        schema: the dataclass broadcast (default ``InputMetadata``); every rank the same
            (its fingerprint is checked at construction).
        tensor_path: ``auto`` (CPU: inside the frame; CUDA: one NCCL broadcast, or inside the
            frame below ``CPMETA_PACKED_MAX_BYTES``), ``packed`` or ``collective``.
        timeout: seconds setup or a step in flight may take before a ``TimeoutError`` naming the
            lagging rank (default ``CPMETA_TRANSPORT_TIMEOUT``; None: no bound); followers wait
            for the next step as long as the driver lives.
        force_remote: send the frame through the process group even on one host.
        checksum: stamp a crc32 on every frame (default ``CPMETA_CHECKSUM``); followers verify
            any frame that carries one and, with it on, refuse a frame without one. Every rank
            must use the same setting (checked at construction: ``ValueError`` naming the ranks).
        persistent_outputs: ``True`` or a depth (an int, ``True`` is 1): every rank gets
            metadata whose tensors live in the broadcaster's arena for the step's layout (fields,
            dtypes, shapes), ``depth`` arenas used in turn, the same object each time that
            arena's turn comes: valid until ``depth`` more broadcasts with the same layout (2:
            "until the broadcast after next", for an overlapped loop). Held layouts and bytes are
            bounded, least recently used dropped first (``cpmeta.broadcast.persistent``).
            Default ``False``: fresh tensors every call.
        metrics: keep per-step counters and latencies for :meth:`stats` (``cpmeta.broadcast.
            metrics``; about 1 us a step, plus ~0.4 us per same-host follower on the driver for
            the ring lag: docs/metrics.md). Default off: nothing is kept on the hot path.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        src: Optional[int] = None,
        device: Optional[torch.device | str] = None,
        *,
        group_src: Optional[int] = None,
        schema: type = InputMetadata,
        tensor_path: Optional[str] = None,
        timeout: Any = ENV_TIMEOUT,
        force_remote: Optional[bool] = None,
        checksum: Optional[bool] = None,
        persistent_outputs: bool | int = False,
        metrics: bool = False,
    ) -> None:
        check_flags(checksum=checksum, metrics=metrics, force_remote=force_remote)
        self.schema: Schema | DictSchema = (INPUT_METADATA if schema is InputMetadata else DictSchema()
                                            if schema is dict else Schema.of(schema))
        self.cls = schema
        self._collect: Any = partial(collect, schema=self.schema) if isinstance(self.schema, Schema) \
            else collect_dict
        depth = depth_of(persistent_outputs)
        if schema is dict and depth:
            raise ValueError("persistent_outputs: tensor dicts (schema=dict) get fresh tensors every call")
        self.group = resolve_group(group)
        self.src = resolve_src(self.group, src, group_src)
        self.rank = dist.get_rank()
        self.is_src = self.rank == self.src
        backend = str(dist.get_backend(self.group)).lower()
        self.device = resolve_device(device, self.group)
        self.tensor_path = tensor_path or envs.tensor_path()
        if self.tensor_path not in envs.TENSOR_PATHS:
            raise ValueError(f"tensor_path: expected one of {envs.TENSOR_PATHS}, got {self.tensor_path!r}")
        if self.tensor_path == "collective" and "nccl" not in backend and self.device.type == "cuda":
            raise ValueError("tensor_path='collective' with CUDA tensors needs an NCCL group")
        self.checksum = envs.checksum() if checksum is None else bool(checksum)
        self._packed_max = envs.packed_max_bytes()
        self._backend = backend
        self._ch = FrameChannel(self.group, self.src, self.schema, what="MetadataBroadcaster",
                                timeout=timeout, force_remote=force_remote, checksum=self.checksum)
        self._objects = self._ch.objects
        self._tensors: Any = None  # TensorChannel, created on first collective use
        self._pin = self.device.type == "cuda"
        self._persist: Any = None  # PersistentArenas with persistent_outputs
        if depth:
            self._persist = PersistentArenas(self.device, depth)
        self._metrics = BroadcastMetrics() if metrics else None
        self._warm_from = None
        self._warming = self._ch.warm_with(self._warm_pieces)  # FollowerSide.warm, piece by piece
        self._mark = 0.0  # this step: when the frame was published (driver) / arrived (follower)
        self._info: tuple[int, bool] = (0, False)  # this step: payload bytes, layout block sent
        self._closed = False

    # ---- public ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Driver: announce the next :meth:`broadcast` before building its metadata.

        Same-host followers parked in their ``broadcast(None)`` wake now and spin (yielding their
        core when the host has fewer cores than ranks) until the frame lands, so the step does
        not pay their OS wake-up. Optional; a no-op on followers (they need nothing new) and on
        the process-group path. Call it once per step, a few hundred us to a few ms ahead.
        """
        if self.is_src and not self._closed:
            self._ch.announce()

    def broadcast(self, md: Any, out: Any = None) -> Any:
        """Return the driver's metadata on every rank (tensors on ``self.device``).

        ``src`` passes its object, every other rank ``None``. Followers receive an
        independently constructed object, bit-identical field by field, aliasing re-created.
        ``out`` (optional, any rank): an object of the schema's class holding existing buffers
        (e.g. captured by a CUDA graph); every received tensor is written into ``out``'s tensor
        at the same path -- the whole buffer, or the prefix ``buf[:n]`` of a buffer with a
        larger first dim -- and the result holds those views (same addresses). A path with no
        buffer, or another dtype / trailing shape, is a ``ValueError`` naming the path.
        """
        m = self._metrics
        if m is None:
            return self._broadcast(md, out)
        t0 = self._mark = perf_counter()
        try:
            got = self._broadcast(md, out)
        except BaseException as e:
            m.refused(e)
            raise
        m.step(t0, self._mark, perf_counter(), *self._info)
        return got

    def stats(self) -> BroadcastStats:
        """This rank's counters and latency summaries (``cpmeta.broadcast.metrics``): steps,
        payload bytes, layouts sent / plans built, time in send (driver) or wait (followers) and
        land, refusals by kind, the driver's ring lag, the persistent arenas' bytes and counts.
        Needs ``metrics=True`` at construction (``RuntimeError`` otherwise)."""
        if self._metrics is None:
            raise RuntimeError("MetadataBroadcaster.stats(): constructed with metrics=False (the "
                               "default); pass metrics=True to keep per-step counters")
        p, ring = self._persist, self._objects.ring
        arenas = None if p is None else dict(
            layouts=len(p), arenas=sum(1 for _ in p.arenas()), host_bytes=p.host_bytes,
            device_bytes=p.device_bytes, persisted=p.persisted, fresh=p.fresh, created=p.created,
            evicted=p.evicted)
        slot = ring.handle.slot_size if ring is not None and self.is_src else 0
        group = str(getattr(self.group, "group_name", "") or "WORLD")
        return self._metrics.stats(self.rank, group, self.is_src, slot, arenas)

    def _broadcast(self, md: Any, out: Any) -> Any:
        """One step (the step protocol of ``cpmeta.broadcast.wire``): a driver call that fails
        before its frame is published sends the followers an abort frame for the step (their
        pending call raises the same builtin error class, naming the step); a follower's refused
        call consumes its step, so every next call is in step."""
        if self._closed:
            raise RuntimeError("MetadataBroadcaster: broadcast() after close()")
        name = self.schema.name
        bad_out = out is not None and (type(out) is not self.cls or self.cls is dict)
        if self.is_src:
            step = self._ch.step
            try:
                if bad_out:
                    raise TypeError(f"out: expected {name} buffers, got {type(out).__name__}")
                if type(md) is not self.cls:
                    raise TypeError(f"rank {self.rank} (src): expected {name}, got {type(md).__name__}")
                return self._send(md, out)
            except BaseException as e:
                if self._ch.step == step:  # its frame never left: every follower gets the error
                    self._ch.abort(e)
                raise
        if md is not None or bad_out:
            err: Exception = (
                ValueError(f"rank {self.rank}: only src={self.src} passes metadata; followers pass None")
                if md is not None else
                TypeError(f"out: expected {name} buffers, got {type(out).__name__}"))
            self.refuse(err)
            raise err
        return self._receive(out)

    def refuse(self, error: BaseException) -> None:
        """This rank's call of the current step is refused with ``error`` (the caller raises
        it): on the driver every follower's pending call raises ``error``'s class naming the
        step; a follower consumes the step's frame (whatever it holds), so its next call is in
        step with the driver. ``broadcast_tensor_dict`` uses it for its own argument checks."""
        if self._closed:
            return
        if self.is_src:
            self._ch.abort(error)
            return
        try:
            self._receive(None)
        except Exception:  # noqa: BLE001 - the step is refused on this rank either way
            pass

    def close(self) -> None:
        """Release the shared-memory ring and channels (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._ch.close()
        if self._tensors is not None and hasattr(self._tensors, "close"):
            self._tensors.close()

    def __enter__(self) -> "MetadataBroadcaster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- driver ---------------------------------------------------------------------------
    def _use_packed(self, tensors: list[torch.Tensor], nbytes: int) -> bool:
        if self.tensor_path != "auto":
            return self.tensor_path == "packed"
        if self.device.type == "cpu" and "nccl" not in self._backend:
            return True
        if not all_cpu(tensors):
            return False
        return nbytes <= self._packed_max

    def _tensor_channel(self) -> Any:
        if self._tensors is None:
            from cpmeta.transport import TensorChannel

            self._tensors = TensorChannel(self.group, self.src, self.device, timeout=self._ch.timeout)
        return self._tensors

    def _send(self, md: Any, out: Any) -> Any:
        ring = self._objects.ring
        if ring is not None and self._metrics is not None:
            self._metrics.backlog(ring.backlog())
        key, tensors, values = self._collect(md)
        try:
            return self._send_collected(md, out, key, tensors, values)
        except RuntimeError:  # torch's error for a sparse or nested tensor names no field
            err = not_dense(key, tensors)
            if err is None:
                raise
            raise err from None
        except ValueError as e:  # the codec's names a value by its place in the values block
            named = value_failure(key, values, str(e))
            if named is None:
                raise
            raise ValueError(named) from None

    def _send_collected(self, md: Any, out: Any, key: tuple, tensors: list[torch.Tensor],
                        values: list[Any]) -> Any:
        prep = self._ch.prepare(key, values, None, tensors)
        self._info = (prep.exact + len(prep.vblock) + len(prep.lblock), bool(prep.lblock))
        packed = self._use_packed(tensors, prep.region)
        if out is not None:  # the driver's out= buffers proven before its frame leaves
            check_out(out, prep.plan, prep.dims)
        arena = None
        if self._persist is not None and out is None:  # the layout's arena (persistent_outputs)
            arena = self._persist.get(prep.plan, prep.dims, prep.numels, prep.starts, prep.region, values)
        if packed:
            return self._send_packed(md, out, prep, tensors, values, arena)
        self._check_devices(prep, tensors)
        if prep.region > wire.MAX_COLLECTIVE_BYTES:  # what the followers would refuse
            raise WireError(f"a tensor region of {prep.region} bytes for the collective, at most "
                            f"MAX_COLLECTIVE_BYTES={wire.MAX_COLLECTIVE_BYTES}")
        # the frame's tensor region, filled before the frame leaves (a failing copy aborts the step)
        buf = arena.fill_device(tensors) if arena is not None else self._region(prep, tensors)
        self._ch.publish(prep, 0, 0, 0, None)
        if prep.region:
            self._tensor_channel().broadcast_buffer(buf)
        self._mark = perf_counter()
        if arena is not None:
            return arena.result(values)
        got = prep.plan.views(buf, prep.dims, prep.numels, prep.starts)
        return prep.plan.assemble(got, values, copy_to_out(out, prep.plan, got) if out is not None else None)

    def _region(self, prep: Prepared, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The collective path without an arena: the step's tensors as the frame's tensor region
        in a fresh uint8 buffer on this rank's device -- CPU tensors packed on the host
        (``Plan.pack``; CUDA: into a pinned buffer, then ONE H2D copy), device tensors copied into
        its views."""
        buf = torch.empty(prep.region, dtype=torch.uint8, device=self.device)
        if all_cpu(tensors):
            host = buf if self.device.type == "cpu" else \
                torch.empty(prep.region, dtype=torch.uint8, pin_memory=True)
            prep.plan.pack(host.data_ptr(), tensors, prep.dims, prep.numels, prep.starts, prep.region)
            if host is not buf:
                buf.copy_(host, non_blocking=True)
        else:
            copy_views(prep.plan.views(buf, prep.dims, prep.numels, prep.starts), tensors)
        return buf

    def _check_devices(self, prep: Prepared, tensors: list[torch.Tensor]) -> None:
        """Every tensor on the CPU or this rank's device type (a meta tensor has no bytes)."""
        if all_cpu(tensors) or (self.device.type == "cuda" and all(map(_IS_CUDA, tensors))):
            return
        for path, t in zip(prep.plan.tensor_paths, tensors):
            if t.device.type not in ("cpu", self.device.type):
                raise ValueError(f"rank {self.rank} (src): {path}: a tensor on {t.device} cannot be "
                                 f"broadcast (CPU or {self.device.type} tensors)")

    def _send_packed(self, md: Any, out: Any, prep: Prepared, tensors: list[torch.Tensor],
                     values: list[Any], arena: Any) -> Any:
        """The tensors inside the frame: straight from the arena / the driver's tensors into the
        ring slot; CUDA tensors through one pinned host buffer."""
        flags, tbytes, region = FLAG_PACKED, prep.exact, prep.region
        staged = None
        if arena is None and (self.device.type != "cpu" or not all_cpu(tensors)):
            self._check_devices(prep, tensors)
            staged = torch.empty(prep.region, dtype=torch.uint8, pin_memory=self._pin)
            prep.plan.pack(staged.data_ptr(), [t if t.is_cpu else t.cpu() for t in tensors],
                           prep.dims, prep.numels, prep.starts, prep.region)
        region_at = [0]

        def write(view: memoryview, addr: int, data_at: int) -> None:
            if arena is not None:
                arena.write(tensors, addr + data_at)  # straight into the slot
                region_at[0] = addr + data_at
            elif staged is not None:
                view[data_at:data_at + prep.region] = tensor_memoryview(staged)
            else:
                prep.plan.pack(addr + data_at, tensors, prep.dims, prep.numels, prep.starts, prep.region)

        if arena is not None and not self._ch.has_readers:  # world 1: the driver's own arena only
            arena.wait_host()
            arena.write(tensors, arena.host_ptr)
            return arena.finish(values)
        self._ch.publish(prep, flags, tbytes, region, write)
        self._mark = perf_counter()
        if arena is not None:
            arena.take(region_at[0])  # the driver's own copy, after the publish
            return arena.finish(values)
        if staged is not None:
            got = prep.plan.views(staged.to(self.device, non_blocking=True), prep.dims, prep.numels,
                                  prep.starts)
        elif out is None:
            return md  # CPU tensors on a CPU device: the driver's own object is the result
        else:
            got = tensors
        return prep.plan.assemble(got, values, copy_to_out(out, prep.plan, got) if out is not None else None)
