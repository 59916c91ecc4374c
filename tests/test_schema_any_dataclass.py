"""Any metadata dataclass on the broadcast (issue 32 item 1): an engine's own class, unchanged.

``FlashAttnMetadata`` below is shaped like a real engine's per-backend metadata (vLLM's
FlashAttention ``AttentionMetadata``): tensors, optional tensors, a dict of tensors, plain
values of several types (ints, a bool, a float, a str, a tuple, a union). It is broadcast on real
gloo ranks by every path (packed, process group, persistent, ``out=``) and must equal the
driver's object field for field; a field the schema cannot classify is refused at construction,
naming it; a pinned dtype / rank of ``InputMetadata`` is refused on the driver, naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from multiproc import run_ranks


@dataclass
class FlashAttnMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [n_seq+1] int32
    seq_lens: torch.Tensor  # [n_seq] int32
    block_table: torch.Tensor  # [n_seq, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    causal: bool = True
    scale: float = 1.0
    backend: str = "flash"
    cascade: Optional[torch.Tensor] = None  # optional prefix-sharing tensor
    scheduler_metadata: Optional[dict[str, torch.Tensor]] = None  # per-group tensors
    group_sizes: tuple[int, ...] = ()
    window: Optional[int | str] = None


def make_meta(step: int, n: int = 5) -> FlashAttnMetadata:
    g = torch.Generator().manual_seed(1000 + step)
    lens = torch.randint(1, 40, (n,), generator=g, dtype=torch.int32)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    tok = int(qsl[-1])
    sched = {"full": torch.arange(n, dtype=torch.int32) * step, "swa": torch.randn(3, generator=g)}
    if step % 3 == 1:
        sched = {}
    return FlashAttnMetadata(
        num_actual_tokens=tok, max_query_len=int(lens.max()), query_start_loc=qsl, seq_lens=lens,
        block_table=torch.randint(0, 999, (n, 4), generator=g, dtype=torch.int32),
        slot_mapping=torch.randint(-1, 10_000, (tok,), generator=g, dtype=torch.int64),
        causal=step % 2 == 0, scale=0.125 * (step + 1), backend=f"flash-{step % 2}",
        cascade=None if step % 2 else torch.ones(2, 3, dtype=torch.bfloat16),
        scheduler_metadata=sched, group_sizes=tuple(range(step % 4)),
        window=(None, 128, "full")[step % 3])


def same(a: FlashAttnMetadata, b: FlashAttnMetadata) -> Optional[str]:
    """None when ``b`` equals ``a`` field for field (tensors: dtype, shape, bytes), else why."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.cpu(), y.cpu())):
                return f"{f.name}: {y!r:.80}"
        elif isinstance(x, dict):
            if not isinstance(y, dict) or set(x) != set(y):  # (entries travel by dtype run)
                return f"{f.name}: keys {y!r:.80}"
            for k in x:
                if not (x[k].dtype == y[k].dtype and torch.equal(x[k], y[k].cpu())):
                    return f"{f.name}.{k}"
        elif type(x) is not type(y) or x != y:
            return f"{f.name}: {x!r} != {y!r}"
    return None


def _engine_rank(rank: int, world: int, mode: str) -> list[Optional[str]]:
    import cpmeta

    kw = {"persistent_outputs": True} if mode == "persistent" else {}
    if mode == "remote":
        kw["force_remote"] = True
    bad: list[Optional[str]] = []
    with cpmeta.MetadataBroadcaster(group_src=0, schema=FlashAttnMetadata, timeout=60, **kw) as bc:
        out = None
        if mode == "out":  # caller-owned buffers, larger than any step needs
            out = FlashAttnMetadata(0, 0, torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32),
                                    torch.zeros(64, 4, dtype=torch.int32), torch.zeros(4096, dtype=torch.int64),
                                    cascade=torch.zeros(2, 3, dtype=torch.bfloat16),
                                    scheduler_metadata={"full": torch.zeros(64, dtype=torch.int32),
                                                        "swa": torch.zeros(3)})
        for step in range(12):
            want = make_meta(step)
            got = bc.broadcast(want if rank == 0 else None, out=out if step % 3 != 1 else None)
            bad.append(same(want, got))
            if out is not None and step % 3 != 1 and rank:
                assert got.slot_mapping.data_ptr() == out.slot_mapping.data_ptr()
    return bad


@pytest.mark.parametrize("mode", ["ring", "remote", "persistent", "out"])
def test_engine_dataclass_equals_driver(mode: str) -> None:
    out = run_ranks(_engine_rank, 3, mode, timeout=180)
    assert all(b is None for r in out for b in r), out


@dataclass
class _Unclassifiable:
    positions: torch.Tensor
    callback: object = None


@dataclass
class _NestedDict:
    deep: Optional[dict[str, dict[str, torch.Tensor]]] = None


def test_unclassifiable_field_refused_naming_it() -> None:
    from cpmeta.broadcast.schema import Schema

    with pytest.raises(TypeError, match=r"_Unclassifiable\.callback"):
        Schema(_Unclassifiable)
    with pytest.raises(TypeError, match=r"_NestedDict\.deep"):
        Schema(_NestedDict)
    with pytest.raises(TypeError, match="dataclass"):
        Schema(dict)


def _refused_at_construction(rank: int, world: int) -> str:
    import cpmeta

    try:
        cpmeta.MetadataBroadcaster(schema=_Unclassifiable, timeout=30)
    except TypeError as e:
        return str(e)
    return "constructed"


def test_unclassifiable_dataclass_refused_by_the_broadcaster_on_every_rank() -> None:
    assert all("callback" in m for m in run_ranks(_refused_at_construction, 2, timeout=60))


def test_pinned_dtype_and_rank_refused_by_path() -> None:
    """InputMetadata's field table pins dtypes and ranks: a float64 ``positions`` (or a 2-D
    one) is refused when the layout's plan is built -- on the driver before anything is sent."""
    from cpmeta.broadcast.collect import collect
    from cpmeta.broadcast.plan import Plan
    from cpmeta.broadcast.schema import INPUT_METADATA
    from cpmeta.metadata import InputMetadata

    for bad, what in ((torch.zeros(4, dtype=torch.float64), "float64 rank 1"),
                      (torch.zeros(2, 2, dtype=torch.int32), "int32 rank 2")):
        key, _, _ = collect(InputMetadata(is_prompt=False, positions=bad))
        with pytest.raises(ValueError, match=rf"positions: {what}, InputMetadata pins int32 rank 1"):
            Plan(INPUT_METADATA, key[0], list(key[1]), list(key[2]), key[3])


def _float_positions(rank: int, world: int) -> str:
    import cpmeta
    from cpmeta.metadata import InputMetadata

    with cpmeta.MetadataBroadcaster(timeout=30) as bc:
        md = InputMetadata(is_prompt=False, positions=torch.zeros(4, dtype=torch.float64))
        if rank == 0:
            try:
                bc.broadcast(md)
            except ValueError as e:
                msg = str(e)
            else:
                msg = "sent"
            ok = InputMetadata(is_prompt=False, positions=torch.zeros(4, dtype=torch.int32))
            bc.broadcast(ok)  # nothing reached the followers: the next step is the first
            return msg
        got = bc.broadcast(None)
        return str(got.positions.dtype)


def test_float_positions_never_reach_a_follower() -> None:
    drv, fol = run_ranks(_float_positions, 2, timeout=60)
    assert "positions: float64" in drv and "pins int32" in drv, drv
    assert fol == "torch.int32"
