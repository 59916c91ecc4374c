"""``MetadataBroadcaster``: every rank of a CP group gets the driver's ``InputMetadata``.

One step, on every rank of ``group``::

    driver (src)                                    follower (parked in broadcast(None))
    [begin_step(): parked followers wake, spin]
    collect by path -> layout key, tensors, values
    layout id (the layout itself only when new)
    ONE frame (cpmeta.broadcast.wire), written straight into the ring slot:
      header | layout? | values | shapes | tensors ── shm ring (same host) ──▶ check header once
                                                    ── gloo bytes (others) ─▶ copy tensors out
    tensors of CUDA metadata above CPMETA_PACKED_MAX_BYTES:                  views (one split per
      ONE coalesced TensorChannel broadcast (NCCL) ───────────────────────▶  dtype run)
                                                                             Plan.assemble
The frame carries a version and a schema fingerprint of ``InputMetadata``'s fields, checked once;
a follower whose ``InputMetadata`` differs raises instead of misreading. Aliasing is kept: two
paths holding the same tensor object (``positions_cp`` is ``positions`` before a mirror) are sent
once and are the same tensor object on the receiver.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Optional

import torch
import torch.distributed as dist

from transport.codec import CodecError, decode_body, encode_body  # cpmeta -> transport only
from transport.coalesce import tensor_memoryview

from .. import envs
from ..metadata import InputMetadata
from . import integrity, wire
from .outputs import copy_out_of_frame, copy_to_out
from .persistent import land_span
from .walk import collect
from .wire import (FLAG_CRC, FLAG_LAYOUT, FLAG_PACKED, FLAG_SPAN, FRAME_MAGIC, HEADER,
                   MAX_LAYOUTS, Plan, WireError, layout_id, pack_tensors)

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION"]

logger = logging.getLogger(__name__)

MESSAGE_VERSION = wire.MESSAGE_VERSION
SCHEMA_FINGERPRINT = wire.SCHEMA_FINGERPRINT


class MetadataBroadcaster:
    """Broadcast ``InputMetadata`` from one driver rank to every rank of ``group``.

    Collective: every rank of ``group`` constructs it (hostnames are exchanged once) and calls
    :meth:`broadcast` the same number of times. Per-rank example with 2 ranks::

        b = MetadataBroadcaster()                    # rank 0 and rank 1
        b.begin_step()                               # rank 0 (optional: before it builds)
        md = b.broadcast(prepare_decode(seqs, cfg))  # rank 0 (src)
        md = b.broadcast(None)                       # rank 1
        b.close()                                    # both

    With a ``DeviceMesh``, name the driver inside the group (torch.distributed's convention)::

        b = MetadataBroadcaster(group=mesh.get_group("cp"), group_src=0)

    Args:
        group: a torch.distributed process group (default WORLD); NCCL or gloo.
        src: GLOBAL rank of the driver (default 0 when ``group_src`` is not given).
        device: where received tensors live (default: current CUDA device for NCCL, else CPU).
        group_src: rank of the driver INSIDE ``group`` (instead of ``src``; both is an error).
        tensor_path: ``auto`` (CPU: inside the frame; CUDA: one NCCL broadcast, or inside the
            frame below ``CPMETA_PACKED_MAX_BYTES``), ``packed`` or ``collective``.
        timeout: seconds any wait may take before a ``TimeoutError`` naming the lagging rank.
        force_remote: send the frame through the process group even on one host.
        checksum: stamp a crc32 on every frame (default ``CPMETA_CHECKSUM``); followers verify
            any frame that carries one and, with it on, refuse a frame without one. Every rank
            must use the same setting (checked at construction: ``ValueError`` naming the ranks).
        persistent_outputs: every rank gets metadata whose tensors live in the broadcaster's
            arena for the step's layout (fields, dtypes, shapes), the same object each time that
            layout comes back: valid until the next ``broadcast`` with the same layout
            (``cpmeta.broadcast.persistent``). Default: fresh tensors every call.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        src: Optional[int] = None,
        device: Optional[torch.device | str] = None,
        *,
        group_src: Optional[int] = None,
        tensor_path: Optional[str] = None,
        timeout: Optional[float] = None,
        force_remote: Optional[bool] = None,
        checksum: Optional[bool] = None,
        persistent_outputs: bool = False,
    ) -> None:
        from transport import ObjectChannel  # cpmeta -> transport, never the reverse

        self.group = group if group is not None else dist.group.WORLD
        self.src = _resolve_src(self.group, src, group_src)
        self.rank = dist.get_rank()
        self.is_src = self.rank == self.src
        backend = str(dist.get_backend(self.group)).lower()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
        self.device = torch.device(device)
        self.tensor_path = tensor_path or envs.tensor_path()
        if self.tensor_path not in envs.TENSOR_PATHS:
            raise ValueError(f"tensor_path: expected one of {envs.TENSOR_PATHS}, got {self.tensor_path!r}")
        if self.tensor_path == "collective" and "nccl" not in backend and self.device.type == "cuda":
            raise ValueError("tensor_path='collective' with CUDA tensors needs an NCCL group")
        self.checksum = envs.checksum() if checksum is None else bool(checksum)
        self._packed_max = envs.packed_max_bytes()
        self._backend = backend
        self._objects = ObjectChannel(self.group, self.src, timeout=timeout, force_remote=force_remote)
        integrity.agree_checksum(self._objects.ctrl, self.checksum)
        self._tensors: Any = None  # TensorChannel, created on first collective use
        self._layouts: dict[tuple, tuple[int, Plan, bytes]] = {}  # driver: key -> (id, plan, block)
        self._plans: dict[int, tuple[bytes, Plan]] = {}  # follower: layout id -> (block, plan)
        self._pin = self.device.type == "cuda"
        self._persist: Any = None  # PersistentArenas with persistent_outputs=True
        if persistent_outputs:
            from .persistent import PersistentArenas

            self._persist = PersistentArenas(self.device)
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
            self._objects.announce()

    def broadcast(self, md: Optional[InputMetadata], out: Optional[InputMetadata] = None
                  ) -> InputMetadata:
        """Return the driver's metadata on every rank (tensors on ``self.device``).

        ``src`` passes its ``InputMetadata``, every other rank ``None``. Followers receive an
        independently constructed object, bit-identical field by field, aliasing re-created.
        ``out`` (optional, any rank): an ``InputMetadata`` of existing buffers (e.g. captured
        by a CUDA graph); every received tensor is written into ``out``'s tensor at the same path
        -- the whole buffer, or the prefix ``buf[:n]`` of a buffer with a larger first dim --
        and the result holds those views (same addresses). A path with no buffer, or another
        dtype / trailing shape, is a ``ValueError`` naming the path.
        """
        if self._closed:
            raise RuntimeError("MetadataBroadcaster: broadcast() after close()")
        if out is not None and not isinstance(out, InputMetadata):
            raise TypeError(f"out: expected InputMetadata buffers, got {type(out).__name__}")
        if self.is_src:
            if not isinstance(md, InputMetadata):
                raise TypeError(f"rank {self.rank} (src): expected InputMetadata, got {type(md).__name__}")
            return self._send(md, out)
        if md is not None:
            raise ValueError(f"rank {self.rank}: only src={self.src} passes metadata; followers pass None")
        return self._receive(out)

    def close(self) -> None:
        """Release the shared-memory ring and channels (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._objects.close()
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
        if any(t.device.type != "cpu" for t in tensors):
            return False
        return nbytes <= self._packed_max

    def _tensor_channel(self) -> Any:
        if self._tensors is None:
            from transport import TensorChannel

            self._tensors = TensorChannel(self.group, self.src, self.device,
                                          timeout=self._objects.timeout)
        return self._tensors

    def _layout(self, key: tuple) -> tuple[int, Plan, bytes]:
        """``(id, plan, layout block to send or b"")`` of a layout key (block only when new)."""
        hit = self._layouts.get(key)
        if hit is not None:
            return hit[0], hit[1], (hit[2] if hit[0] < 0 else b"")
        if len(self._layouts) >= MAX_LAYOUTS:
            self._layouts.clear()  # followers drop theirs oldest first: resend from now on
        block = encode_body([key[0], list(key[1]), list(key[2]), key[3]])
        plan, lid = Plan(key[0], list(key[1]), list(key[2]), key[3]), layout_id(block)
        if any(h[0] == lid for h in self._layouts.values()):  # crc32 collision: never cached
            self._layouts[key] = (-1, plan, block)
            return lid, plan, block
        self._layouts[key] = (lid, plan, block)
        return lid, plan, block

    def _send(self, md: InputMetadata, out: Optional[InputMetadata]) -> InputMetadata:
        key, tensors, values, dims = (*collect(md), None) if self._persist is None else \
            self._persist.collect.step(md)
        lid, plan, lblock = self._layout(key)
        if lid < 0:
            lid = layout_id(lblock)
        if dims is None:  # (a memo hit read them already)
            dims = tuple([d for t in tensors for d in t.shape])
        numels, starts, tbytes, exact = plan.sizes(dims)
        packed = self._use_packed(tensors, tbytes)
        try:
            plan.check_values(values)  # a bad value is the driver's ValueError naming the path
            vblock = encode_body(values)
        except Exception:
            if lblock:  # this layout never reached the wire: its next frame must carry it
                self._layouts.pop(key, None)
            raise
        shapes_at, data_at = integrity.blocks_at(len(lblock), len(vblock), plan.n_dims)
        flags = (FLAG_LAYOUT if lblock else 0) | (FLAG_PACKED if packed else 0) | (
            FLAG_CRC if self.checksum else 0)
        arena = None
        if self._persist is not None and out is None:  # the layout's arena (persistent_outputs)
            if packed:
                arena = self._persist.driver_arena(plan, dims, numels, starts, tbytes,
                                                   exact, values, tensors)
                if arena.span is not None:  # the tensors' own allocation as one span
                    flags, tbytes = flags | FLAG_SPAN, arena.region
            else:
                arena = self._persist.get(plan, dims, numels, starts, tbytes, values)[0]
        staged = None
        if arena is None and packed and (
                self.device.type != "cpu" or any(t.device.type != "cpu" for t in tensors)):
            staged = torch.empty(tbytes, dtype=torch.uint8, pin_memory=self._pin)
            cpu = [t if t.device.type == "cpu" else t.cpu() for t in tensors]
            pack_tensors(staged.data_ptr(), cpu, plan, numels, starts)

        def fill(view: memoryview, addr: int) -> None:
            HEADER.pack_into(view, 0, FRAME_MAGIC, wire.MESSAGE_VERSION, flags,
                             wire.SCHEMA_FINGERPRINT.encode(), lid, 0, len(lblock), len(vblock),
                             plan.n_dims, 0, exact if packed else 0)
            at = HEADER.size
            view[at:at + len(lblock)] = lblock
            at += len(lblock)
            view[at:at + len(vblock)] = vblock
            plan.shapes.pack_into(view, shapes_at, *dims)
            if arena is not None and packed:
                arena.write(tensors, addr + data_at)  # straight into the slot
                region_at[0] = addr + data_at
            elif staged is not None:
                view[data_at:data_at + tbytes] = tensor_memoryview(staged)
            elif packed:
                pack_tensors(addr + data_at, tensors, plan, numels, starts)
            integrity.seal(view, data_at, self.checksum)

        region_at = [0]
        if not self._objects.has_readers:  # world 1: no frame, nobody would read it
            if arena is not None and packed:
                arena.wait_host()  # the tensors straight into the driver's own arena
                arena.write(tensors, arena.host_ptr)
                return arena.finish(values)
        else:
            self._objects.send_frame(data_at + (tbytes if packed else 0), fill)
        if arena is not None:
            if packed:
                arena.take(region_at[0])  # the driver's own copy, after the publish
                return arena.finish(values)
            return arena.finish_collective(
                self._tensor_channel().broadcast(tensors), values)
        if not packed:
            got = self._tensor_channel().broadcast(tensors)
        elif staged is not None:
            got = plan.views(staged.to(self.device, non_blocking=True), dims, numels, starts)
        elif out is None:
            return md  # CPU tensors on a CPU device: the driver's own object is the result
        else:
            got = tensors
        if out is not None:
            return plan.assemble(got, values, copy_to_out(out, plan, got))
        return plan.assemble(got, values)

    # ---- follower -------------------------------------------------------------------------
    def _receive(self, out: Optional[InputMetadata]) -> InputMetadata:
        try:
            plan, values, dims, numels, starts, buf = self._objects.recv_frame(self._consume)
        except (CodecError, WireError, KeyError, TypeError, ValueError, IndexError,
                struct.error) as e:
            raise RuntimeError(f"rank {self.rank}: malformed metadata message from src={self.src}: "
                               f"{type(e).__name__}: {e}") from None
        if buf is None:  # tensors follow in one collective (NCCL)
            specs, at = [], 0
            for c, nd in zip(plan.codes, plan.ndims):
                specs.append((wire.WIRE_DTYPES[c], tuple(dims[at:at + nd])))
                at += nd
            got = self._tensor_channel().broadcast(specs)
            if self._persist is not None and out is None:
                return self._persist.get(plan, dims, numels, starts, plan.sizes(dims)[2],
                                         values)[0].finish_collective(got, values)
        elif not isinstance(buf, torch.Tensor):  # a LayoutArena (landed by _consume)
            if out is None:
                return buf.finish(values)
            got = buf.tensors
            buf.finish(values)
        else:
            if self.device.type != "cpu":
                buf = buf.to(self.device, non_blocking=True)
            got = plan.views(buf, dims, numels, starts)
        per_path = copy_to_out(out, plan, got) if out is not None else None
        try:
            return plan.assemble(got, values, per_path)
        except (TypeError, ValueError, AttributeError) as e:
            raise RuntimeError(f"rank {self.rank}: malformed metadata message from src={self.src}: "
                               f"{type(e).__name__}: {e}") from None

    def _consume(self, view: memoryview) -> tuple:
        """Check and parse one frame (untrusted bytes, valid only during this call)."""
        n = view.nbytes
        if n < HEADER.size:
            raise WireError(f"truncated frame: {n} bytes")
        (magic, version, flags, schema, lid, crc, llen, vlen, n_dims, meta, tbytes
         ) = HEADER.unpack_from(view, 0)
        if magic != FRAME_MAGIC:
            raise WireError(f"bad magic {bytes(magic)!r} (not a metadata frame)")
        if version != wire.MESSAGE_VERSION:
            raise RuntimeError(f"rank {self.rank}: metadata message version mismatch: driver sent "
                               f"{version}, this rank speaks {wire.MESSAGE_VERSION}")
        if schema != wire.SCHEMA_FINGERPRINT.encode():  # read per step: tests skew it
            raise RuntimeError(
                f"rank {self.rank}: InputMetadata schema fingerprint mismatch: driver "
                f"{bytes(schema).decode('ascii', 'replace')!r}, this rank {wire.SCHEMA_FINGERPRINT!r} "
                "(driver and follower run different cpmeta versions)")
        shapes_at, data_at = integrity.check_frame(view, flags, crc, meta, llen, vlen, n_dims,
                                                   self.checksum)
        plan = None
        if flags & FLAG_LAYOUT:
            block = bytes(view[HEADER.size:HEADER.size + llen])
            cached = self._plans.get(lid)
            if cached is not None and cached[0] == block:
                plan = cached[1]
            else:
                plan = integrity.plan_from_block(block, lid)
        else:
            cached = self._plans.get(lid)
            block, plan = cached if cached is not None else (b"", None)
        if plan is None:
            raise RuntimeError(
                f"rank {self.rank}: metadata frame from src={self.src} refers to layout id {lid}, "
                "which this rank never received (it joined late or missed a frame); every rank "
                "must construct the broadcaster together and receive every step")
        values = decode_body(view[HEADER.size + llen:HEADER.size + llen + vlen], max_bytes=n)
        plan.check_values(values)
        if n_dims != plan.n_dims:
            raise WireError(f"{n_dims} dims declared, the layout has {plan.n_dims}")
        dims = plan.shapes.unpack_from(view, shapes_at)
        if flags & FLAG_SPAN:  # a persistent driver's span (cpmeta.broadcast.span): own checks
            if not flags & FLAG_PACKED:
                raise WireError("FLAG_SPAN without FLAG_PACKED")
            arena = land_span(self._persist, plan, dims, tbytes, view, data_at, values, self.device)
            self._keep_plan(lid, block, plan)
            return plan, values, dims, None, None, arena
        numels, starts, total = plan.check_tensors(dims, bool(flags & FLAG_PACKED), tbytes,
                                                   n - data_at)
        if not flags & FLAG_PACKED:
            self._keep_plan(lid, block, plan)
            return plan, values, dims, numels, starts, None
        if self._persist is not None:  # the frame's region into the layout's arena, one memmove
            arena = self._persist.get(plan, dims, numels, starts, total, values)[0]
            arena.land(view, data_at)
            self._keep_plan(lid, block, plan)
            return plan, values, dims, numels, starts, arena
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
        if total:
            copy_out_of_frame(buf, view, data_at, total)
        self._keep_plan(lid, block, plan)
        return plan, values, dims, numels, starts, buf

    def _keep_plan(self, lid: int, block: bytes, plan: Plan) -> None:
        """Cache a plan once its frame passed every check (oldest dropped past MAX_LAYOUTS)."""
        if self._plans.pop(lid, None) is None and len(self._plans) >= MAX_LAYOUTS:
            del self._plans[next(iter(self._plans))]
        self._plans[lid] = (block, plan)  # most recently used last


def _resolve_src(group: Any, src: Optional[int], group_src: Optional[int]) -> int:
    """Global rank of the driver from ``src`` (global) or ``group_src`` (inside ``group``)."""
    ranks = dist.get_process_group_ranks(group)
    if src is not None and group_src is not None:
        raise ValueError(f"give src (global rank) or group_src (rank inside the group), not both: "
                         f"src={src}, group_src={group_src}")
    if group_src is not None:
        if type(group_src) is not int or not 0 <= group_src < len(ranks):
            raise ValueError(f"group_src: expected a rank inside the group (0..{len(ranks) - 1}), "
                             f"got {group_src!r}")
        return ranks[group_src]
    src = 0 if src is None else src
    if src not in ranks:
        raise ValueError(f"src: global rank {src} is not in the group (global ranks {ranks}); "
                         "to name the driver by its rank inside the group use group_src=")
    return src
