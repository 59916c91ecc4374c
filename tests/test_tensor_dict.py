"""``cpmeta.broadcast_tensor_dict`` (issue 32 item 2): vLLM's semantics on cpmeta's frame.

Real gloo ranks; the driver's dicts change keys, kinds, dtypes and shapes between calls (new
layouts) and repeat (cached layouts); every rank must return an equal dict: the same keys in the
same order, equal plain values of the same types (tuples stay tuples, ``None`` stays), tensors
with the driver's dtype, shape and bytes, aliased keys one tensor. Where vLLM imports (the
benchmark environment), its ``GroupCoordinator.broadcast_tensor_dict`` is fed the same dicts.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from multiproc import run_ranks


def make_dict(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    n = 3 + step % 5
    ids = torch.randint(0, 32000, (n,), generator=g, dtype=torch.int64)
    d: dict[str, Any] = {
        "input_tokens": ids,
        "input_positions": torch.arange(n, dtype=torch.int32) + step,
        "num_seqs": n,
        "is_prompt": step % 2 == 0,
        "temperature": 0.7,
        "virtual_engine": None,
        "seq_lens": [int(x) for x in range(n)],
        "shape": (n, 4),
        "request.ids": f"r{step}",  # a dot is fine in a tensor-dict key
    }
    if step % 3 == 0:
        d["slot_mapping"] = torch.randint(-1, 999, (n,), generator=g, dtype=torch.int64)
        d["alias_of_ids"] = ids  # two keys, one tensor
    if step % 4 == 1:
        d["hidden"] = torch.randn(n, 8, generator=g, dtype=torch.float32).to(torch.bfloat16)
        d = dict(reversed(list(d.items())))  # another key order: another layout
    return d


def equal(a: dict[str, Any], b: dict[str, Any]) -> str:
    if list(a) != list(b):
        return f"keys {list(b)} != {list(a)}"
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x, y)):
                return f"{k}: {y!r:.60}"
        elif type(x) is not type(y) or x != y:
            return f"{k}: {y!r:.60} != {x!r:.60}"
    if ("alias_of_ids" in a) and b["alias_of_ids"] is not b["input_tokens"]:
        return "aliasing lost"
    return "equal"


def _rank(rank: int, world: int) -> list[str]:
    import cpmeta
    import cpmeta.broadcast

    out = []
    for step in range(14):
        want = make_dict(step)
        got = cpmeta.broadcast_tensor_dict(want if rank == 0 else None, src=0)
        out.append("equal" if rank == 0 and got is want else equal(want, got))
    cpmeta.broadcast.close_tensor_dict_channels()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_returns_an_equal_dict(world: int) -> None:
    out = run_ranks(_rank, world, timeout=120)
    assert all(r == ["equal"] * 14 for r in out), out


def _refusals(rank: int, world: int) -> list[str]:
    import numpy as np

    import cpmeta
    import cpmeta.broadcast

    res = []
    import warnings

    with warnings.catch_warnings():  # (nested tensors are a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    for bad in ({"x": {"nested": [1, np.int64(2)]}}, {(1, 2): 1}, {"x": object()},
                {"s": torch.Size([2])}, {"a": torch.ones(2), "m": [torch.eye(2).to_sparse()]},
                {"n": nested}, {"c": torch.eye(2).to_sparse_csr()}, {"x": "\ud800"}, {"a": {"\udc00": 1}}):
        try:  # refused on the driver before its frame is written; every follower's call of
            cpmeta.broadcast_tensor_dict(bad if rank == 0 else None)  # the step raises it too
            res.append("sent")
        except (TypeError, ValueError) as e:
            res.append(type(e).__name__ + ": " + str(e)[:160])
    ok = cpmeta.broadcast_tensor_dict({"ok": 1} if rank == 0 else None)  # the next call is fine
    res.append(str(ok))
    import torch.distributed as dist

    alone = [dist.new_group([r]) for r in range(world)][rank]  # a group of one: the same checks
    for bad in ({"m": torch.eye(2).to_sparse()}, {"a": {"\udc00": 1}}):
        try:
            cpmeta.broadcast_tensor_dict(bad, group=alone)
            res.append("sent")
        except (TypeError, ValueError) as e:
            res.append(str(e)[:42])
    dist.barrier()  # (rank 0 hosts the store the groups were made through)
    cpmeta.broadcast.close_tensor_dict_channels()
    return res


def test_bad_dicts_refused_on_the_driver_naming_the_key() -> None:
    drv, fol = run_ranks(_refusals, 2, timeout=120)
    assert drv[0].startswith("TypeError") and "x.nested.1: int64" in drv[0], drv
    assert "(1, 2)" in drv[1] and "x: object" in drv[2] and "s: Size" in drv[3], drv
    # torch's own errors for these name no key (a sparse tensor's copy, a nested tensor's shape)
    assert drv[4:7] == [f"TypeError: {k}: a {kind} tensor cannot be broadcast (dense, strided tensors only: "
                        ".to_dense() it first)" for k, kind in (("m.0", "sparse_coo"), ("n", "nested"),
                                                                 ("c", "sparse_csr"))], drv
    # a str msgpack cannot encode (a lone surrogate) was named by its place in the values block,
    # "$[0][4]"; the refused key is escaped in the text (the abort frame must encode)
    assert drv[7:9] == ["ValueError: x: 'utf-8' codec can't encode character '\\ud800' in position 0: surrogates "
                        "not allowed", "ValueError: a.\\udc00: 'utf-8' codec can't encode character '\\udc00' in "
                        "position 0: surrogates not allowed"], drv
    for d, f in zip(drv[:9], fol[:9]):  # the same error class on the follower, naming the path
        assert f.split(":")[0] == d.split(":")[0] and d.split(": ", 1)[1][:30] in f, (d, f)
    assert drv[9] == fol[9] == "{'ok': 1}", (drv, fol)
    assert drv[10] == fol[10] == "m: a sparse_coo tensor cannot be broadcast", (drv, fol)
    assert drv[11] == fol[11] == drv[8][len("ValueError: "):][:42], (drv, fol)


def _vllm_rank(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from vllm.distributed.parallel_state import GroupCoordinator

    import cpmeta

    import cpmeta.broadcast

    gc = GroupCoordinator([list(range(world))], rank, "gloo", False, False, group_name="cmp")
    out = []
    for step in range(8):
        want = make_dict(step)
        ours = cpmeta.broadcast_tensor_dict(want if rank == 0 else None, src=0)
        theirs = gc.broadcast_tensor_dict(want if rank == 0 else None, src=0)
        out.append(equal(theirs, ours))
    cpmeta.broadcast.close_tensor_dict_channels()
    dist.barrier()
    return out


@pytest.mark.skipif(os.environ.get("CPMETA_VLLM_COMPARE") != "1",
                    reason="vLLM comparison: set CPMETA_VLLM_COMPARE=1 where vllm imports "
                           "(the benchmark environment)")
def test_equals_vllm_broadcast_tensor_dict() -> None:
    pytest.importorskip("vllm.distributed.parallel_state")
    out = run_ranks(_vllm_rank, 2, timeout=180)
    assert all(r == ["equal"] * 8 for r in out), out
