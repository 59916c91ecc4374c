"""Tests of ``cpmeta.compute_slot_mapping`` (docs/design.md section 11) against the per-token reference.

CPU: named cases per branch, validation errors, hypothesis random cases and properties.
CUDA (skipped without a GPU): the Triton kernel against the reference and the torch path.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpmeta
from cpmeta import compute_slot_mapping
from cpmeta.cp.slot_mapping import (
    SlotMappingError,
    describe_slot_mapping_error,
)

sys.path.insert(0, os.path.dirname(__file__))
from reference_slot_mapping import rank_local_index, reference_slot_mapping  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    """One call: list inputs plus keyword arguments of compute_slot_mapping."""

    qsl: list[int]
    positions: list[int]
    table: list[list[int]]
    block_size: int
    kw: dict[str, Any] = field(default_factory=dict)

    def tensors(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max((len(r) for r in self.table), default=0)
        bt = torch.tensor(self.table, dtype=torch.int32) if width else torch.zeros(
            (len(self.table), 0), dtype=torch.int32)
        return (torch.tensor(self.qsl, dtype=torch.int32, device=device),
                torch.tensor(self.positions, dtype=torch.int64, device=device).reshape(-1),
                bt.to(device))

    def run(self, device: str = "cpu", **extra: Any) -> torch.Tensor:
        return compute_slot_mapping(*self.tensors(device), self.block_size, **{**self.kw, **extra})

    def reference(self) -> torch.Tensor:
        ref = reference_slot_mapping(self.qsl, self.positions, self.table, self.block_size, **self.kw)
        return torch.tensor(ref, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Named cases, one per branch
# ---------------------------------------------------------------------------------------------


def test_exported_from_package() -> None:
    assert cpmeta.compute_slot_mapping is compute_slot_mapping


def test_docstring_example_plain() -> None:
    c = Case([0, 2, 3], [5, 6, 0], [[7, 3], [9, 9]], 4, dict(max_num_tokens=5))
    assert c.run().tolist() == [13, 14, 36, -1, -1]
    assert torch.equal(c.run(), c.reference())


@pytest.mark.parametrize("rank", [0, 1])
def test_seed_worked_example(rank: int) -> None:
    """cp=2, interleave=128, block=128: rank 0 owns 0..127 and 256..383 -> local 0..255."""
    identity = [list(range(8))]  # block id == block index, so slot == rank-local offset
    c = Case([0, 512], list(range(512)), identity, 128,
             dict(max_num_tokens=512, cp_world_size=2, cp_rank=rank, cp_interleave=128))
    got = c.run()
    assert torch.equal(got, c.reference())
    mine = [range(0, 128), range(256, 384)] if rank == 0 else [range(128, 256), range(384, 512)]
    expected = torch.full((512,), -1, dtype=torch.int32)
    expected[list(mine[0]) + list(mine[1])] = torch.arange(256, dtype=torch.int32)
    assert torch.equal(got, expected)


def test_cp_blocks_per_kv_block_hand_computed() -> None:
    """bs=4, kvb=8 (2 blocks per KV block), W=2, I=2: vbs=16; rank 0 owns pairs 0-1, 4-5, ..."""
    c = Case([0, 24], list(range(24)), [[100, 101, 102, 103]], 4,
             dict(max_num_tokens=26, kv_cache_block_size=8, cp_world_size=2, cp_interleave=2))
    got = c.run().tolist()
    owned = {0: 400, 1: 401, 4: 402, 5: 403, 8: 404, 9: 405, 12: 406, 13: 407,
             16: 408, 17: 409, 20: 410, 21: 411}
    assert got == [owned.get(p, -1) for p in range(24)] + [-1, -1]
    assert torch.equal(c.run(), c.reference())


def test_circular() -> None:
    c = Case([0, 5], [-2, -1, 0, 5, 9], [[7]], 4, dict(max_num_tokens=6, circular=True))
    assert c.run().tolist() == [-1, -1, 28, 29, 29, -1]
    assert torch.equal(c.run(), c.reference())


def test_circular_negative_positions_read_nothing() -> None:
    c = Case([0, 2], [-3, -1], [[]], 4, dict(max_num_tokens=2, circular=True))
    assert c.run().tolist() == [-1, -1]


def test_non_local_tokens_read_nothing() -> None:
    """Position 5 belongs to rank 1; rank 0's formula would give block 2, past the 2-entry row."""
    c = Case([0, 4], [0, 2, 5, 3], [[10, 11]], 1,
             dict(max_num_tokens=4, cp_world_size=2, cp_rank=0, cp_interleave=1))
    assert c.run().tolist() == [10, 11, -1, -1]


def test_tail_padding_pad_id_and_out() -> None:
    c = Case([0, 1, 1, 3], [3, 0, 1], [[5], [6], [8]], 4, dict(max_num_tokens=7, pad_id=-7))
    out = torch.zeros(7, dtype=torch.int32)
    res = c.run(out=out)
    assert res is out
    assert out.tolist() == [23, 32, 33, -7, -7, -7, -7]


def test_no_requests_all_padding() -> None:
    c = Case([0], [], [[]], 16, dict(max_num_tokens=3))
    assert c.run().tolist() == [-1, -1, -1]
    assert Case([0], [], [[]], 16, dict(max_num_tokens=0)).run().shape == (0,)


def test_dtypes_and_strided_block_table() -> None:
    wide = torch.arange(40, dtype=torch.int64).reshape(4, 10) * 3
    bt = wide[1:3, ::2]  # rows 1-2, every second column: non-contiguous
    qsl = torch.tensor([0, 2, 4], dtype=torch.int64)
    pos = torch.tensor([0, 9, 4, 1], dtype=torch.int32)
    got = compute_slot_mapping(qsl, pos, bt, 4, max_num_tokens=4)
    ref = reference_slot_mapping([0, 2, 4], [0, 9, 4, 1], bt.tolist(), 4, max_num_tokens=4)
    assert got.dtype == torch.int32 and got.tolist() == ref


def test_cp_world_size_one_ignores_kvb_and_interleave() -> None:
    c = Case([0, 6], [0, 3, 4, 9, 17, 30], [[4, 9, 1, 7]], 8,
             dict(max_num_tokens=6, kv_cache_block_size=24, cp_interleave=3))
    plain = Case(c.qsl, c.positions, c.table, 8, dict(max_num_tokens=6))
    assert torch.equal(c.run(), plain.reference())


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

GOOD = Case([0, 2, 3], [0, 5, 1], [[1, 2], [3, 4]], 4, dict(max_num_tokens=4))


def _call(case: Case, tensors: Optional[tuple] = None, bs: Optional[int] = None, **kw: Any) -> Any:
    qsl, pos, bt = tensors if tensors is not None else case.tensors()
    return compute_slot_mapping(qsl, pos, bt, case.block_size if bs is None else bs, **{**case.kw, **kw})


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(bs=0), ValueError, "block_size"),
        (dict(bs=True), TypeError, "block_size"),
        (dict(max_num_tokens=2), ValueError, "max_num_tokens"),
        (dict(max_num_tokens=-1), ValueError, "max_num_tokens"),
        (dict(cp_world_size=2, cp_rank=2), ValueError, "cp_rank"),
        (dict(cp_world_size=0), ValueError, "cp_world_size"),
        (dict(cp_world_size=2, circular=True), ValueError, "circular"),
        (dict(cp_world_size=2, kv_cache_block_size=6), ValueError, "kv_cache_block_size"),
        (dict(cp_world_size=2, kv_cache_block_size=8, cp_interleave=3), ValueError, "cp_interleave"),
        (dict(cp_interleave=0), ValueError, "cp_interleave"),
        (dict(pad_id=2**31), ValueError, "pad_id"),
        (dict(circular=1), TypeError, "circular"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(backend="triton"), ValueError, "backend"),
        (dict(out=torch.zeros(4, dtype=torch.int64)), TypeError, "out"),
        (dict(out=torch.zeros(5, dtype=torch.int32)), ValueError, "out"),
        (dict(error_out=torch.zeros(2, dtype=torch.int32)), ValueError, "error_out"),
    ],
)
def test_argument_errors(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        _call(GOOD, **kw)


def _tensors(qsl: list, pos: list, table: list, pos_dtype: torch.dtype = torch.int64) -> tuple:
    return (torch.tensor(qsl, dtype=torch.int32), torch.tensor(pos, dtype=pos_dtype),
            torch.tensor(table, dtype=torch.int32))


@pytest.mark.parametrize(
    "tensors, kw, match",
    [
        (_tensors([1, 2, 3], [0, 5, 1], [[1, 2], [3, 4]]), {}, r"query_start_loc\[0\]: expected 0, got 1"),
        (_tensors([0, 3, 2, 3], [0, 5, 1], [[1, 2], [3, 4], [5, 6]]), {},
         r"query_start_loc: expected non-decreasing.*query_start_loc\[1\]=3 > query_start_loc\[2\]=2"),
        (_tensors([0, 2, 4], [0, 5, 1], [[1, 2], [3, 4]]), {}, r"positions: expected num_tokens .* = 4"),
        (_tensors([0, 2, 3], [0, -5, 1], [[1, 2], [3, 4]]), {}, r"positions\[1\]: expected >= 0 \(request 0"),
        (_tensors([0, 2, 3], [0, 5, 9], [[1, 2], [3, 4]]), {},
         r"block_table: request 1 token 2 \(position 9\) needs block index 2, but its row has 2"),
        (_tensors([0, 2, 3], [0, 5, 1], [[1, 2]]), {}, r"block_table: expected at least num_reqs = 2 rows"),
        (_tensors([0, 2, 3], [0, 5, 1], [[1, 2**29], [3, 4]]), {}, r"block_table: request 0 token 1: .*int32"),
        (_tensors([0, 2, 3], [0, 5, 1], [[1, 2], [3, 4]], torch.float32), {}, r"positions: expected dtype"),
        ((torch.tensor([[0, 3]]), torch.tensor([0, 5, 1]), torch.tensor([[1, 2]])), {}, "query_start_loc"),
        ((torch.tensor([], dtype=torch.int32), torch.tensor([0]), torch.tensor([[1]])), {}, "query_start_loc"),
        ((torch.tensor([0, 1]), torch.tensor([[0]]), torch.tensor([[1]])), {}, "positions"),
        ((torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1], dtype=torch.int32)), {}, "block_table"),
        (([0, 1], torch.tensor([0]), torch.tensor([[1]])), {}, "query_start_loc"),
    ],
)
def test_data_errors(tensors: tuple, kw: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        _call(GOOD, tensors=tensors, **kw)


def test_error_out_records_bits_without_raising() -> None:
    err = torch.zeros(1, dtype=torch.int32)
    qsl, pos, bt = _tensors([0, 2, 3], [0, -5, 9], [[1, 2], [3, 4]])
    out = compute_slot_mapping(qsl, pos, bt, 4, max_num_tokens=4, error_out=err)
    assert int(err) == SlotMappingError.NEGATIVE_POSITION | SlotMappingError.BLOCK_INDEX
    assert out.shape == (4,) and out[3] == -1
    text = describe_slot_mapping_error(err)
    assert text is not None and "positions" in text and "block_table" in text
    assert describe_slot_mapping_error(0) is None


def test_bad_input_never_reads_out_of_bounds() -> None:
    """Every failing check raises ValueError (not IndexError from an unguarded gather)."""
    qsl, pos, bt = _tensors([0, 1, 3], [0, 10**9, 2**40], [[1], [3]])
    with pytest.raises(ValueError, match="block_table"):
        compute_slot_mapping(qsl, pos, bt, 4, max_num_tokens=3)


# ---------------------------------------------------------------------------------------------
# Random cases and properties
# ---------------------------------------------------------------------------------------------


@st.composite
def layouts(draw: Any, circular_ok: bool = True, cp: Optional[bool] = None, contiguous: Optional[bool] = None,
            max_pos: int = 400) -> Case:
    """A valid random call: requests with contiguous chunks or scattered positions."""
    bs = draw(st.sampled_from([1, 2, 4, 8, 16, 128]))
    world = draw(st.sampled_from([2, 3, 4])) if cp or (cp is None and draw(st.booleans())) else 1
    inter = draw(st.sampled_from([1, 2, 4, 8, 128]))
    kvb = bs * draw(st.sampled_from([1, 2, 4]))
    while kvb % inter:
        kvb *= 2
    circular = world == 1 and circular_ok and draw(st.integers(0, 3)) == 0
    lens = draw(st.lists(st.integers(0, 40), min_size=0, max_size=5))
    positions: list[int] = []
    for n in lens:
        scattered = not contiguous if contiguous is not None else draw(st.booleans())
        if scattered:
            lo = -4 if circular else 0
            positions += draw(st.lists(st.integers(lo, max_pos), min_size=n, max_size=n))
        else:
            start = draw(st.integers(0, max_pos))
            positions += list(range(start, start + n))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    width = max([p // bs + 1 for p in positions] + [1]) + draw(st.integers(0, 2))
    rows = len(lens) + draw(st.integers(0, 2))
    rnd = draw(st.randoms(use_true_random=False))  # block ids: cheap to draw, still shrinkable
    table = [[rnd.randint(0, 5000) for _ in range(width)] for _ in range(rows)] or [[0] * width]
    kw = dict(max_num_tokens=qsl[-1] + draw(st.integers(0, 40)), kv_cache_block_size=kvb,
              cp_world_size=world, cp_rank=draw(st.integers(0, world - 1)), cp_interleave=inter,
              circular=circular, pad_id=draw(st.sampled_from([-1, 0, -99])))
    return Case(qsl, positions, table, bs, kw)


@HYP
@given(layouts())
def test_random_cases_match_reference(c: Case) -> None:
    assert torch.equal(c.run(), c.reference())


@HYP
@given(layouts(cp=True, contiguous=True))
def test_cp_every_token_local_to_exactly_one_rank(c: Case) -> None:
    world = c.kw["cp_world_size"]
    pad = c.kw["pad_id"] = -1  # block ids are >= 0, so -1 marks "not mine" unambiguously
    per_rank = torch.stack([c.run(cp_rank=r) for r in range(world)])
    n = c.qsl[-1]
    assert torch.equal((per_rank[:, :n] != pad).sum(0), torch.ones(n, dtype=torch.int64))
    for t, p in enumerate(c.positions):
        owner = (p // c.kw["cp_interleave"]) % world
        assert per_rank[owner, t] != pad


@HYP
@given(layouts(circular_ok=False, max_pos=300), st.data())
def test_non_pad_slots_distinct_per_request(c: Case, data: Any) -> None:
    """Distinct block ids and distinct positions in a request give distinct slots."""
    width, rnd = len(c.table[0]), data.draw(st.randoms(use_true_random=False))
    c.table = [rnd.sample(range(width * 3), width) for _ in c.table]
    c = _dedup(c)
    slots = c.run()
    for q in range(len(c.qsl) - 1):
        mine = [s for s in slots[c.qsl[q]:c.qsl[q + 1]].tolist() if s != c.kw["pad_id"]]
        assert len(mine) == len(set(mine))


def _dedup(c: Case) -> Case:
    """Drop repeated positions inside each request (rebuilding query_start_loc)."""
    qsl, positions = [0], []
    for q in range(len(c.qsl) - 1):
        uniq = sorted(set(c.positions[c.qsl[q]:c.qsl[q + 1]]))
        positions += uniq
        qsl.append(qsl[-1] + len(uniq))
    kw = dict(c.kw, max_num_tokens=qsl[-1], pad_id=-1)
    return Case(qsl, positions, c.table, c.block_size, kw)


@HYP
@given(layouts(cp=False))
def test_world_size_one_equals_plain_formula(c: Case) -> None:
    if c.kw["circular"]:
        return
    plain = [-1] * c.kw["max_num_tokens"]
    for q in range(len(c.qsl) - 1):
        for t in range(c.qsl[q], c.qsl[q + 1]):
            p = c.positions[t]
            plain[t] = c.table[q][p // c.block_size] * c.block_size + p % c.block_size
    c.kw["pad_id"] = -1
    assert c.run().tolist() == plain


@HYP
@given(layouts(cp=True, max_pos=200))
def test_cp_slot_is_rank_local_dense_index(c: Case) -> None:
    """With block id == block index, a local token's slot is its count among the rank's positions."""
    width = len(c.table[0])
    c.table = [list(range(width)) for _ in c.table]
    world, inter, rank = c.kw["cp_world_size"], c.kw["cp_interleave"], c.kw["cp_rank"]
    slots = c.run().tolist()
    for t, p in enumerate(c.positions):
        if (p // inter) % world == rank:
            assert slots[t] == rank_local_index(p, world, inter)
        else:
            assert slots[t] == c.kw["pad_id"]


# ---------------------------------------------------------------------------------------------
# CUDA: the Triton kernel
# ---------------------------------------------------------------------------------------------


@needs_cuda
@HYP
@given(layouts())
def test_cuda_matches_reference_and_torch_path(c: Case) -> None:
    ref = c.reference()
    tri = c.run("cuda")
    torch_path = c.run("cuda", backend="torch")
    assert tri.device.type == "cuda"
    assert torch.equal(tri.cpu(), ref) and torch.equal(torch_path.cpu(), ref)


@needs_cuda
@pytest.mark.parametrize("tile_case", ["seed", "large"])
def test_cuda_named_cases(tile_case: str) -> None:
    if tile_case == "seed":
        c = Case([0, 512], list(range(512)), [list(range(8))], 128,
                 dict(max_num_tokens=600, cp_world_size=2, cp_rank=0, cp_interleave=128))
    else:  # many tiles per request, window crossing block boundaries, tail padding > 1 tile
        g = torch.Generator().manual_seed(0)
        lens = [70000, 1, 0, 3000]
        positions = sum((list(range(s, s + n)) for s, n in zip([17, 5, 0, 123456], lens)), [])
        qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
        table = torch.randint(0, 2**20, (4, 200000 // 16), generator=g).tolist()
        c = Case(qsl, positions, table, 16, dict(max_num_tokens=qsl[-1] + 5000, cp_world_size=4,
                                                 cp_rank=3, cp_interleave=1, kv_cache_block_size=64))
    assert torch.equal(c.run("cuda").cpu(), c.run("cpu"))


@needs_cuda
def test_cuda_errors_match_cpu_messages() -> None:
    bad = _tensors([0, 2, 3], [0, 5, 9], [[1, 2], [3, 4]])
    with pytest.raises(ValueError) as cpu_err:
        compute_slot_mapping(*bad, 4, max_num_tokens=4)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError) as gpu_err:
            compute_slot_mapping(*(t.cuda() for t in bad), 4, max_num_tokens=4, backend=backend)
        assert str(gpu_err.value) == str(cpu_err.value)
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        compute_slot_mapping(*(t.cuda() for t in bad), 4, max_num_tokens=4, backend=backend, error_out=err)
        assert int(err) == SlotMappingError.BLOCK_INDEX


@needs_cuda
def test_cuda_out_buffer_in_place_and_strided_table() -> None:
    wide = (torch.arange(60, dtype=torch.int32).reshape(6, 10) * 7).cuda()
    bt = wide[::2, 1::3]
    qsl = torch.tensor([0, 3, 3, 5], device="cuda")
    pos = torch.tensor([0, 4, 11, 2, 3], device="cuda", dtype=torch.int32)
    out = torch.zeros(8, dtype=torch.int32, device="cuda")
    res = compute_slot_mapping(qsl, pos, bt, 4, max_num_tokens=8, out=out)
    assert res is out
    ref = reference_slot_mapping(qsl.tolist(), pos.tolist(), bt.tolist(), 4, max_num_tokens=8)
    assert out.tolist() == ref


def test_kernel_tiling_helpers() -> None:
    """Window and tile sizing of the Triton kernel (pure host arithmetic, no triton needed)."""
    from cpmeta.gpu.slot_mapping_triton import choose_tile, window_size

    assert [window_size(1024, b) for b in (128, 16, 1, 4096)] == [16, 128, 2048, 2]
    assert window_size(4096, 16) == 512
    assert choose_tile(8192, 256) == (256, 1)
    assert choose_tile(65536, 64) == (1024, 4)
    assert choose_tile(65536, 1) == (4096, 16)
    assert choose_tile(0, 0) == (256, 1)
