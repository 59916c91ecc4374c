"""Any metadata dataclass on the broadcast (issue 32 item 1): an engine's own class, unchanged.

``FlashAttnMetadata`` below is shaped like a real engine's per-backend metadata (vLLM's
FlashAttention ``AttentionMetadata``): tensors, optional tensors, a dict of tensors, plain
values of several types (ints, a bool, a float, a str, a tuple, a union). It is broadcast on real
gloo ranks by every path (packed, process group, persistent, ``out=``) and must equal the
driver's object field for field; a field the schema cannot classify is refused at construction,
naming it; a pinned dtype / ndim of ``InputMetadata`` is refused on the driver, naming the field.
Per-layer metadata keyed by layer index (``Dict[int, Tensor]``) keeps int keys on every rank; a
class without fields, or a pin that cannot hold, is refused by ``Schema.of`` saying what is wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, Optional

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


def test_pinned_dtype_and_ndim_refused_by_path() -> None:
    """InputMetadata's field table pins dtypes and ndims: a float64 ``positions`` (or a 2-D
    one) is refused when the layout's plan is built -- on the driver before anything is sent.
    The message says "ndim" (at 4ac8a65 it said "rank", the word cpmeta uses for a process)."""
    from cpmeta.broadcast.collect import collect
    from cpmeta.broadcast.plan import Plan
    from cpmeta.broadcast.schema import INPUT_METADATA
    from cpmeta.metadata import InputMetadata

    for bad, what in ((torch.zeros(4, dtype=torch.float64), "float64 ndim 1"),
                      (torch.zeros(2, 2, dtype=torch.int32), "int32 ndim 2")):
        key, _, _ = collect(InputMetadata(is_prompt=False, positions=bad))
        with pytest.raises(ValueError, match=rf"positions: {what}, InputMetadata pins int32 ndim 1"):
            Plan(INPUT_METADATA, key[0], list(key[1]), list(key[2]), key[3])


def _float_positions(rank: int, world: int) -> list[str]:
    import cpmeta
    from cpmeta.metadata import InputMetadata

    out = []
    with cpmeta.MetadataBroadcaster(timeout=30) as bc:
        md = InputMetadata(is_prompt=False, positions=torch.zeros(4, dtype=torch.float64))
        try:  # refused on the driver before its frame is written: the followers' call of the
            bc.broadcast(md if rank == 0 else None)  # step raises the same error, naming it
            out.append("sent")
        except ValueError as e:
            out.append(str(e))
        ok = InputMetadata(is_prompt=False, positions=torch.zeros(4, dtype=torch.int32))
        got = bc.broadcast(ok if rank == 0 else None)  # the next step is fine on every rank
        out.append(str(got.positions.dtype))
    return out


def test_float_positions_never_reach_a_follower() -> None:
    drv, fol = run_ranks(_float_positions, 2, timeout=60)
    assert "positions: float64" in drv[0] and "pins int32" in drv[0], drv
    assert "positions: float64" in fol[0] and "pins int32" in fol[0], fol
    assert drv[1] == fol[1] == "torch.int32", (drv, fol)


@dataclass
class PerLayerMetadata:
    """Per-layer metadata keyed by layer index, as an engine with per-layer KV groups keeps it."""

    num_tokens: int
    slot_mapping: torch.Tensor
    layer_block_tables: Dict[int, torch.Tensor]
    layer_window: Optional[Dict[int, int]] = None


def make_layers(step: int) -> PerLayerMetadata:
    g = torch.Generator().manual_seed(500 + step)
    n = 2 + step % 3
    layers = (0, 1, 2, 61) if step % 2 else (0, 5, -1)
    return PerLayerMetadata(
        num_tokens=n, slot_mapping=torch.randint(0, 999, (n,), generator=g),
        layer_block_tables={i: torch.randint(0, 99, (n, 4), generator=g, dtype=torch.int32)
                            for i in layers},
        layer_window={i: 128 * (i + 2) for i in layers} if step % 3 else None)


def same_layers(a: PerLayerMetadata, b: PerLayerMetadata) -> Optional[str]:
    if (a.num_tokens, a.layer_window) != (b.num_tokens, b.layer_window) or not torch.equal(
            a.slot_mapping, b.slot_mapping):
        return f"plain fields or slot_mapping: {b!r:.120}"
    if sorted(a.layer_block_tables) != sorted(b.layer_block_tables) or not all(
            type(k) is int for k in b.layer_block_tables):
        return f"layer keys {list(b.layer_block_tables)!r}"
    for k, t in a.layer_block_tables.items():
        if not torch.equal(t, b.layer_block_tables[k]):
            return f"layer_block_tables[{k}]"
    return None


def _layers_rank(rank: int, world: int) -> list[Optional[str]]:
    import cpmeta

    res: list[Optional[str]] = []
    for kw in ({}, {"persistent_outputs": True}):
        with cpmeta.MetadataBroadcaster(group_src=world - 1, schema=PerLayerMetadata, timeout=60,
                                        **kw) as bc:
            for step in range(6):
                want = make_layers(step)
                got = bc.broadcast(want if rank == world - 1 else None)
                res.append(same_layers(want, got))
            bad = PerLayerMetadata(1, torch.zeros(1, dtype=torch.int64), {"3": torch.zeros(1, 4)})
            try:  # a str key in an int-keyed field: refused on the driver, named on every rank
                bc.broadcast(bad if rank == world - 1 else None)
                res.append("a str key sent as an int")
            except TypeError as e:
                res.append(None if "PerLayerMetadata.layer_block_tables: dict key '3' is str" in str(e)
                           else str(e))
            got = bc.broadcast(make_layers(9) if rank == world - 1 else None)  # the next step is fine
            res.append(same_layers(make_layers(9), got))
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_dict_int_tensor_field_keys_arrive_as_ints(world: int) -> None:
    """Fails at 4ac8a65: ``Schema.of`` refused ``Dict[int, Tensor]`` (only str keys), so the
    broadcaster could not be constructed. Now the layer indices (negative ones too) arrive as
    ints on every rank, on the fresh and the persistent path, and a driver whose dict holds the
    key ``"3"`` (which would arrive as the int 3) is refused naming the field."""
    out = run_ranks(_layers_rank, world, timeout=240)
    assert all(r is None for rank in out for r in rank), out


@dataclass
class _NoFields:
    pass


def _pinned(info: object) -> type:
    @dataclass
    class Pinned:
        positions: torch.Tensor = field(metadata={"cpmeta": info})
    return Pinned


@dataclass
class _PinnedValue:
    count: int = field(default=0, metadata={"cpmeta": SimpleNamespace(dtype=torch.int32, ndim=None)})


def test_fieldless_and_mispinned_schemas_refused_saying_what_is_wrong() -> None:
    """Fails at 4ac8a65: a field-less class raised ``attrgetter expected 1 argument`` and every
    pin below was accepted (to be refused, if ever, by a confusing layout error at a step)."""
    from cpmeta.broadcast.schema import Schema

    with pytest.raises(TypeError, match="_NoFields: a dataclass without fields has nothing to broadcast"):
        Schema.of(_NoFields)
    cases = [(SimpleNamespace(dtype="int32", ndim=None), r"positions: pins dtype 'int32', expected None or one of"),
             (SimpleNamespace(dtype=torch.complex64, ndim=1), r"pins dtype torch.complex64"),
             (SimpleNamespace(dtype=None, ndim=-1), r"positions: pins ndim -1, expected None or an int in 0..16"),
             (SimpleNamespace(dtype=torch.int32, ndim=True), r"pins ndim True")]
    for info, msg in cases:
        with pytest.raises(TypeError, match=msg):
            Schema.of(_pinned(info))
    with pytest.raises(TypeError, match=r"_PinnedValue.count: pins dtype torch.int32 / ndim None, but "
                                        r"only a tensor field"):
        Schema.of(_PinnedValue)
    ok = Schema.of(_pinned(SimpleNamespace(dtype=torch.int32, ndim=1)))
    assert (ok.specs["positions"].dtype, ok.specs["positions"].ndim) == (torch.int32, 1)


def _skewed_class(rank: int, world: int) -> str:
    import cpmeta

    fields = [("num_tokens", int), ("slot_mapping", torch.Tensor),
              ("window", Optional[int | str] if rank == 0 else Optional[int], None),
              ("per_group", Optional[dict[str, torch.Tensor]], None)]
    engine_meta = dataclasses.make_dataclass("EngineMeta", fields)  # one name, two definitions
    try:
        cpmeta.MetadataBroadcaster(group_src=0, schema=engine_meta, timeout=30)
    except ValueError as e:
        return str(e)
    return "constructed"


def test_schema_mismatch_names_the_class_and_the_first_differing_field() -> None:
    """Fails at 4ac8a65: the set-up's message named only the two fingerprints ("'af6af678a0229f8a'
    at ranks [0], ..."). Now every rank names the class, the first field whose declaration
    differs, and the ranks holding each version."""
    for msg in run_ranks(_skewed_class, 2, timeout=120):
        assert "MetadataBroadcaster schema differs across the group: class " in msg, msg
        assert "EngineMeta, first difference at field 2: 'window: int | str' at ranks [0], " \
               "'window: int' at ranks [1]" in msg, msg
