"""The methods ``scripts/bench_broadcast.py`` compares: cpmeta, cpmeta with ``begin_step``,
cpmeta with ``persistent_outputs=True``,
``broadcast_object_list``, vLLM's ``broadcast_tensor_dict`` scheme, vLLM's MessageQueue and a
floor. Each is a :class:`Method` whose ``step(md_or_None)`` runs on every rank of the group."""

from __future__ import annotations

from typing import Any, Optional

import torch

FLOOR_MSG_BYTES = 4096


def payload_bytes(md: Any) -> int:
    seen = {id(t): t.numel() * t.element_size() for _, t in md.tensors()}
    return sum(seen.values())


class Method:
    """One way to move metadata; ``step(md_or_None)`` runs on every rank, returns the metadata."""

    def __init__(self, rank: int, device: torch.device, group: Any) -> None:
        self.rank, self.device, self.group = rank, device, group

    def prepare(self, md: Any) -> Any:  # driver-side object handed to step() (not timed)
        return md

    def announce(self) -> None:  # driver, engine mode: before its idle time (not timed)
        pass

    def step(self, md: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CpmetaMethod(Method):
    persistent = False

    def __init__(self, rank: int, device: torch.device, group: Any) -> None:
        super().__init__(rank, device, group)
        import cpmeta

        self.bc = cpmeta.MetadataBroadcaster(src=0, device=device, timeout=120,
                                             persistent_outputs=self.persistent)

    def step(self, md: Any) -> Any:
        return self.bc.broadcast(md if self.rank == 0 else None)

    def close(self) -> None:
        self.bc.close()


class CpmetaBeginStepMethod(CpmetaMethod):
    """cpmeta with ``begin_step()`` announced before the driver's idle (build) time."""

    def announce(self) -> None:
        begin = getattr(self.bc, "begin_step", None)  # absent before issue 17: plain cpmeta
        if begin is not None:
            begin()


class CpmetaPersistentMethod(CpmetaBeginStepMethod):
    """cpmeta with ``persistent_outputs=True`` (and ``begin_step`` in engine mode): a repeated
    layout is one copy into the driver's arena, one memmove into the slot, one out per follower."""

    persistent = True


class BolMethod(Method):
    def step(self, md: Any) -> Any:
        import torch.distributed as dist

        box = [md if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]


class TensorDictMethod(Method):
    """Metadata list via broadcast_object_list, then one async broadcast per tensor."""

    def __init__(self, rank: int, device: torch.device, group: Any) -> None:
        super().__init__(rank, device, group)
        import torch.distributed as dist

        self.cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None

    def step(self, md: Any) -> Any:
        import torch.distributed as dist

        from cpmeta.metadata import InputMetadata

        if self.rank == 0:
            flat = md.to_flatten_dict()
            meta = [(k, ("T", str(v.dtype), tuple(v.shape), v.device.type)) if isinstance(v, torch.Tensor)
                    else (k, v) for k, v in flat.items()]
            tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
        else:
            meta = None
        box = [meta]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        meta = box[0]
        out: dict[str, Any] = {}
        handles = []
        idx = 0
        for k, v in meta:
            if isinstance(v, tuple) and len(v) == 4 and v[0] == "T":
                if self.rank == 0:
                    t = tensors[idx]
                    idx += 1
                else:
                    dt = getattr(torch, v[1].removeprefix("torch."))
                    t = torch.empty(v[2], dtype=dt, device=v[3] if self.device.type == "cuda" else "cpu")
                if t.numel():
                    g = self.cpu_group if t.device.type == "cpu" and self.cpu_group is not None else None
                    handles.append(dist.broadcast(t, src=0, group=g, async_op=True))
                out[k] = t
            else:
                out[k] = v
        for h in handles:
            h.wait()
        return InputMetadata.from_flatten_dict(out)


class CpmetaTensorDictMethod(Method):
    """``cpmeta.broadcast_tensor_dict`` (the drop-in for vLLM's ``GroupCoordinator.
    broadcast_tensor_dict``) carrying ``md.to_flatten_dict()``: one frame, the layout cached by
    the dict's keys and kinds (empty-dict fields are left out: a tensor dict's values are plain)."""

    def step(self, md: Any) -> Any:
        import cpmeta
        from cpmeta.metadata import InputMetadata

        flat = None
        if self.rank == 0:
            flat = {k: v for k, v in md.to_flatten_dict().items() if v is not None and not isinstance(v, dict)}
        got = cpmeta.broadcast_tensor_dict(flat, src=0)
        return md if self.rank == 0 else InputMetadata.from_flatten_dict(got)

    def close(self) -> None:
        from cpmeta.broadcast import close_tensor_dict_channels

        close_tensor_dict_channels()


class FloorMethod(Method):
    """One broadcast of a preallocated buffer of the payload's bytes + one 4 KiB message."""

    def prepare(self, md: Any) -> Any:
        n = payload_bytes(md)
        self.buf = torch.zeros(max(1, n), dtype=torch.uint8, device=self.device)
        self.msg = torch.zeros(FLOOR_MSG_BYTES, dtype=torch.uint8, device=self.device)
        return md

    def step(self, md: Any) -> Any:
        import torch.distributed as dist

        dist.broadcast(self.msg, src=0)
        dist.broadcast(self.buf, src=0)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return md


class MessageQueueMethod(Method):
    """vLLM's shm MessageQueue carrying the whole metadata object (pickled), if vllm imports."""

    def __init__(self, rank: int, device: torch.device, group: Any) -> None:
        super().__init__(rank, device, group)
        import torch.distributed as dist
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        cpu_group = dist.new_group(backend="gloo")
        self.mq = MessageQueue.create_from_process_group(cpu_group, 1 << 24, 6)

    def step(self, md: Any) -> Any:
        if self.rank == 0:
            self.mq.enqueue(md)
            return md
        return self.mq.dequeue()


def make_method(name: str, rank: int, device: torch.device) -> Optional[Method]:
    import torch.distributed as dist

    cls = {"cpmeta": CpmetaMethod, "cpmeta+bs": CpmetaBeginStepMethod,
           "cpmeta+p": CpmetaPersistentMethod, "bol": BolMethod, "tdict": TensorDictMethod,
           "cpmeta-tdict": CpmetaTensorDictMethod,
           "floor": FloorMethod, "mq": MessageQueueMethod}[name]
    if name == "mq":
        ok = torch.tensor([1])
        try:
            import vllm  # noqa: F401
        except Exception:
            ok[0] = 0
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # CPU tensor: the gloo side of the group
        if not int(ok):
            return None
    return cls(rank, device, None)
