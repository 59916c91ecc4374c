"""``cpmeta.broadcast_tensor_dict`` as a drop-in for vLLM's (issue 39 item 5, issue 38 item 1).

The dicts here are shaped like what vLLM's model runners hand ``broadcast_tensor_dict``: tensors
at the top and inside a nested attention-metadata dict, per-layer tensors under int keys, an
enum-keyed dict of tensors, enum values, ``None``, a bool, a float, strings, lists and tuples
mixing tensors with plain values, one tensor under two paths, empty containers. On real gloo
ranks (2 and 3) every follower must return the driver's dict with enums as their values and
everything else equal: keys of the same types in the same order at every depth, the same
container types, tensors with the driver's dtype, shape and bytes, one tensor wherever the
driver held one object. ``src`` is the driver's rank inside the group, as in vLLM.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch

from multiproc import run_ranks


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def vllm_dict(step: int) -> dict[Any, Any]:
    """A model-input dict as vLLM's runners build it (deterministic per ``step``)."""
    g = torch.Generator().manual_seed(7000 + step)
    n = 2 + step % 4
    ids = torch.randint(0, 32000, (n,), generator=g)
    lens = torch.randint(1, 64, (n,), generator=g, dtype=torch.int32)
    attn = {
        "slot_mapping": torch.randint(-1, 4096, (n,), generator=g),
        "seq_lens_tensor": lens,
        "block_tables": torch.randint(0, 512, (n, 4), generator=g, dtype=torch.int32),
        "seq_lens": [int(x) for x in lens],
        "max_decode_seq_len": int(lens.max()),
        "use_cuda_graph": step % 2 == 0,
        "multi_modal_placeholder_index_maps": None,
        "per_layer": {layer: torch.full((n,), layer, dtype=torch.int32) for layer in (0, 1, 31)},
    }
    return {
        "input_tokens": ids,
        "input_positions": torch.arange(n, dtype=torch.int64) + step,
        "attn_metadata": attn,
        "sampling": {"selected_token_indices": torch.arange(n),
                     "categorized_sample_indices": {SamplingType.GREEDY: torch.arange(n // 2),
                                                    SamplingType.RANDOM: torch.arange(n // 2, n)}},
        "virtual_engine": step % 2,
        "is_prompt": step % 3 == 0,
        "temperature": 0.25 * step,
        "kind": StepKind.PREFILL if step % 3 == 0 else StepKind.DECODE,
        "priority": SamplingType.RANDOM,
        "lora_requests": [],
        "prompt_adapter_mapping": None,
        "finished_requests_ids": [f"req-{i}" for i in range(step % 3)],
        "kv_caches": [torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g).to(torch.bfloat16)],
        "shape": (n, 4),
        "mixed": (ids, 1, "x", None, [2.5, False]),
        7: "an int key at the top",
        "alias_of_tokens": ids,
        "empty": {},
    }


def as_received(x: Any) -> Any:
    """What a follower should hold for the driver's ``x``: enums (keys and values) as their
    values, every other object as it is."""
    if isinstance(x, enum.Enum):
        return as_received(x.value)
    if type(x) is dict:
        return {as_received(k): as_received(v) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(as_received(v) for v in x)
    return x


def diff(want: Any, got: Any, path: str = "$", same: Optional[dict[int, Any]] = None) -> Optional[str]:
    """None when ``got`` equals ``want`` as described in the module doc, else the first path
    that differs and how. ``same`` maps the driver's tensor ids to the follower's objects."""
    same = {} if same is None else same
    if isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(got, want)):
            return f"{path}: {got!r:.60} != {want!r:.60}"
        if same.setdefault(id(want), got) is not got:
            return f"{path}: one tensor on the driver, two on the follower"
        return None
    if type(got) is not type(want):
        return f"{path}: {type(got).__name__} {got!r:.40} != {type(want).__name__} {want!r:.40}"
    if type(want) is dict:
        if [(type(k), k) for k in got] != [(type(k), k) for k in want]:
            return f"{path}: keys {list(got)!r:.80} != {list(want)!r:.80}"
        for k in want:
            d = diff(want[k], got[k], f"{path}.{k}", same)
            if d:
                return d
        return None
    if type(want) in (list, tuple):
        if len(got) != len(want):
            return f"{path}: {len(got)} items != {len(want)}"
        for i, (a, b) in enumerate(zip(want, got)):
            d = diff(a, b, f"{path}[{i}]", same)
            if d:
                return d
        return None
    return None if got == want else f"{path}: {got!r:.40} != {want!r:.40}"


def _steps(rank: int, src_global: int, src: int, group: Any, steps: int) -> list[Optional[str]]:
    import cpmeta

    out: list[Optional[str]] = []
    for step in range(steps):
        for d in (vllm_dict(step), {"a": None}, {}, {"a": {}, 3: [], "t": ()}):
            got = cpmeta.broadcast_tensor_dict(d if rank == src_global else None, src=src, group=group)
            if rank == src_global:
                out.append(None if got is d else "the driver did not get its own dict back")
            else:
                out.append(diff(as_received(d), got))
    return out


def _vllm_rank(rank: int, world: int) -> list[Optional[str]]:
    import torch.distributed as dist

    import cpmeta.broadcast

    res = _steps(rank, world - 1, world - 1, None, 5)  # WORLD, the last rank drives
    # a sub-group: src is the rank INSIDE it (vLLM's convention). World 3: group [0, 2], src=1
    # is global rank 2 (global rank 1 is not even a member); world 2: group [0, 1], src=1.
    members = [0, 2] if world == 3 else [0, 1]
    sub = dist.new_group(members)
    if rank in members:
        res += _steps(rank, members[1], 1, sub, 3)
        try:
            cpmeta.broadcast_tensor_dict({"x": 1} if rank == members[1] else None, src=2, group=sub)
            res.append("src=2 accepted in a group of 2")
        except ValueError as e:
            res.append(None if "0..1" in str(e) else str(e))
    cpmeta.broadcast.close_tensor_dict_channels()
    dist.barrier()
    return res


def test_vllm_shaped_dicts_arrive_equal_on_2_ranks() -> None:
    """Fails at 4ac8a65: its tensor dict took only str keys and flat values, so the first dict
    (nested ``attn_metadata``, the int key 7, enums) was a ``TypeError`` on the driver."""
    out = run_ranks(_vllm_rank, 2, timeout=240)
    assert all(r is None for rank in out for r in rank), out


def test_vllm_shaped_dicts_arrive_equal_on_3_ranks_and_a_subgroup() -> None:
    """Fails at 4ac8a65 as above (nested dicts, int keys and enums were refused); the sub-group
    half also proves ``src`` names the rank inside the group (global rank 2 drives as src=1)."""
    out = run_ranks(_vllm_rank, 3, timeout=240)
    assert all(r is None for rank in out for r in rank), out
    assert len(out[1]) == 20 and len(out[0]) == len(out[2]) == 20 + 12 + 1, [len(r) for r in out]


def _many_keys(rank: int, world: int) -> list[Optional[str]]:
    import cpmeta
    import cpmeta.broadcast

    res: list[Optional[str]] = []
    wide = {f"k{i}": i for i in range(3000)} | {i: [i, str(i)] for i in range(2000)}
    wide["ids"] = torch.arange(5)
    got = cpmeta.broadcast_tensor_dict(wide if rank == 0 else None)
    res.append(None if rank == 0 else diff(wide, got))
    many = {f"t{i}": torch.full((1,), i) for i in range(1023)}  # the documented limit
    got = cpmeta.broadcast_tensor_dict(many if rank == 0 else None)
    res.append(None if rank == 0 else diff(many, got))
    too_many = {**many, "one_more": torch.zeros(1)}
    try:
        cpmeta.broadcast_tensor_dict(too_many if rank == 0 else None)
        res.append("1,024 distinct tensors sent")
    except TypeError as e:  # the driver's error, and every follower's pending call raises it
        res.append(None if "1024 distinct tensors" in str(e) and "MAX_TENSORS=1023" in str(e) else str(e))
    huge = {f"k{i}": i for i in range(120_000)}  # ~1.3 MiB of msgpack: over the values limit
    try:
        cpmeta.broadcast_tensor_dict(huge if rank == 0 else None)
        res.append("1.3 MiB of values sent")
    except ValueError as e:  # refused on the driver before it writes a byte, on every rank
        res.append(None if "MAX_VALUES_BYTES" in str(e) else str(e))
    got = cpmeta.broadcast_tensor_dict({"after": 1} if rank == 0 else None)
    res.append(None if got == {"after": 1} else repr(got))
    cpmeta.broadcast.close_tensor_dict_channels()
    return res


def test_more_than_1024_keys_and_the_tensor_limit() -> None:
    """Fails at 4ac8a65: every key was a layout path of at most 1,024 and had to be a str, so
    the 5,001-key dict (2,000 int keys) was refused on the driver. Now only distinct tensors
    count (at most 1,023 per dict); the 1,024th is refused on the driver naming the limit (every
    follower's call of that step raises it too), as is a dict whose plain part is over the 1 MiB
    values limit (120,000 entries), and the next call works."""
    out = run_ranks(_many_keys, 2, timeout=240)
    assert all(r is None for rank in out for r in rank), out


def _follower_mistake(rank: int, world: int) -> list[Optional[str]]:
    import cpmeta
    import cpmeta.broadcast

    res: list[Optional[str]] = []
    for step in range(4):  # flat dicts (4ac8a65 took those): only the follower's mistake differs
        d = {"ids": torch.arange(step + 2), "step": step, "name": f"s{step}"}
        mine = d if rank == 0 or step == 1 else None  # step 1: the follower passes a dict too
        try:
            got = cpmeta.broadcast_tensor_dict(mine)
        except ValueError as e:
            res.append(None if rank and step == 1 and "only the driver" in str(e) else str(e))
            continue
        res.append(None if rank == 0 else diff(d, got))
    cpmeta.broadcast.close_tensor_dict_channels()
    return res


def test_a_follower_that_passes_a_dict_stays_in_step() -> None:
    """Fails at 4ac8a65: the follower raised before it consumed step 1's frame, so its call of
    step 2 returned step 1's dict (and every later call the previous step's). Now the refused
    call consumes its step: steps 2 and 3 arrive as themselves."""
    drv, fol = run_ranks(_follower_mistake, 2, timeout=180)
    assert drv == [None] * 4 and fol == [None] * 4, (drv, fol)
