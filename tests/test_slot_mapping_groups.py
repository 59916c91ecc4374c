"""Several KV-cache groups in one call (docs/design.md section 11): equal to one ``compute_slot_mapping`` per group.

CPU torch path in-process; the fused Triton kernel (one launch, grid ``(num_reqs + 1, n_groups)``)
and the single-group kernel in a subprocess under ``TRITON_INTERPRET=1`` (this file run as a
script), and on CUDA when present.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cpmeta
import cpmeta.cp
from cpmeta import compute_slot_mapping
from cpmeta.cp import KVCacheGroup, compute_slot_mapping_groups

CUDA = torch.cuda.is_available()
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def per_group(qsl: torch.Tensor, pos: torch.Tensor, groups: list[KVCacheGroup], mnt: int, **kw: Any) -> torch.Tensor:
    """The oracle: one compute_slot_mapping call per group, stacked."""
    return torch.stack([
        compute_slot_mapping(qsl, pos, g.block_table, g.block_size, max_num_tokens=mnt,
                             kv_cache_block_size=g.kv_cache_block_size, circular=g.circular,
                             backend="torch", **kw)
        for g in groups])


def random_case(rng: random.Random, device: str = "cpu") -> tuple[Any, ...]:
    """Random requests and 1-3 groups (full attention / sliding window / circular tail)."""
    world = rng.choice([1, 1, 2, 3, 4])
    inter = rng.choice([1, 2, 4])
    n_req = rng.randint(0, 5)
    lens = [rng.randint(0, 40) for _ in range(n_req)]
    starts = [rng.randint(0, 300) for _ in range(n_req)]
    pos = [s + j for s, n in zip(starts, lens) for j in range(n)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    groups = []
    for g in range(rng.randint(1, 3)):
        bs = rng.choice([4, 8, 16])
        kvb = bs * rng.choice([1, 2]) if world > 1 else None
        if kvb is not None and kvb % inter:
            kvb = bs * inter
        circular = world == 1 and g == 2
        cols = 1 if circular else 400 // bs + 2
        table = torch.randint(0, 5000, (n_req + rng.randint(0, 2), cols), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)), dtype=torch.int32)
        if rng.random() < 0.3:  # a strided view
            table = torch.cat([table, table], 1)[:, ::2]
        groups.append(KVCacheGroup(table.to(device), bs, kvb, circular))
    kw = dict(cp_world_size=world, cp_rank=rng.randrange(world), cp_interleave=inter)
    mnt = qsl[-1] + rng.randint(0, 9)
    return (torch.tensor(qsl, dtype=torch.int32, device=device),
            torch.tensor(pos, dtype=torch.int64, device=device), groups, mnt, kw)


def test_docstring_example() -> None:
    qsl, pos = torch.tensor([0, 3]), torch.tensor([0, 17, 40])
    groups = [KVCacheGroup(torch.tensor([[5, 6, 7]], dtype=torch.int32), 16),
              KVCacheGroup(torch.tensor([[2]], dtype=torch.int32), 64)]
    got = compute_slot_mapping_groups(qsl, pos, groups, max_num_tokens=4)
    assert got.tolist() == [[80, 97, 120, -1], [128, 145, 168, -1]]
    assert cpmeta.cp.compute_slot_mapping_groups is compute_slot_mapping_groups


@pytest.mark.parametrize("seed", range(40))
def test_random_groups_equal_per_group_calls(seed: int) -> None:
    qsl, pos, groups, mnt, kw = random_case(random.Random(seed))
    assert torch.equal(compute_slot_mapping_groups(qsl, pos, groups, max_num_tokens=mnt, **kw),
                       per_group(qsl, pos, groups, mnt, **kw))


def test_errors_name_the_group() -> None:
    qsl, pos = torch.tensor([0, 2]), torch.tensor([0, 9])
    ok = KVCacheGroup(torch.tensor([[1, 2, 3]], dtype=torch.int32), 4)
    short = KVCacheGroup(torch.tensor([[1]], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"groups\[1\]: block_table"):
        compute_slot_mapping_groups(qsl, pos, [ok, short], max_num_tokens=2)
    with pytest.raises(ValueError, match=r"groups\[0\]: cp_interleave"):
        compute_slot_mapping_groups(qsl, pos, [ok], max_num_tokens=2, cp_world_size=2, cp_interleave=3)
    with pytest.raises(ValueError, match=r"groups\[0\]: circular"):
        compute_slot_mapping_groups(qsl, pos, [KVCacheGroup(ok.block_table, 4, circular=True)],
                                    max_num_tokens=2, cp_world_size=2)
    with pytest.raises(TypeError, match="groups"):
        compute_slot_mapping_groups(qsl, pos, ok, max_num_tokens=2)  # type: ignore[arg-type]
    err = torch.zeros(1, dtype=torch.int32)
    compute_slot_mapping_groups(qsl, pos, [ok, short], max_num_tokens=2, error_out=err)
    assert int(err) == int(cpmeta.cp.slot_mapping.SlotMappingError.BLOCK_INDEX)
    out = torch.full((2, 5), 7, dtype=torch.int32)
    assert compute_slot_mapping_groups(qsl, pos, [ok, ok], max_num_tokens=5, out=out) is out
    with pytest.raises(ValueError, match="out"):
        compute_slot_mapping_groups(qsl, pos, [ok], max_num_tokens=5, out=out)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_kernel_in_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--interpret"], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "SKIP:" in proc.stdout:
        pytest.skip(proc.stdout.split("SKIP:", 1)[1].strip())
    assert "interpreter cases passed" in proc.stdout


def _interpreter_runs_loaded_loops() -> bool:
    """Whether this Triton interpreter runs ``for i in range(tl.load(p), ...)`` (both kernels loop
    over a request's rows that way). Triton 3.6's cannot with numpy >= 2.5: it turns the loaded
    one-element array into an int by ``int(array)``, which numpy 2.5 refuses."""
    import triton.language as tl

    @triton.jit
    def probe(p):
        for i in range(tl.load(p), tl.load(p + 1)):
            tl.store(p + 2, i)

    t = torch.tensor([0, 2, -1], dtype=torch.int32)
    try:
        probe[(1,)](t)
    except Exception as e:  # the interpreter wraps it: InterpreterError(TypeError(...))
        if "0-dimensional arrays" in repr(e):
            return False
        raise
    assert int(t[2]) == 1
    return True


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(20))
def test_cuda_one_launch_equals_per_group(seed: int) -> None:
    qsl, pos, groups, mnt, kw = random_case(random.Random(seed), "cuda")
    got = compute_slot_mapping_groups(qsl, pos, groups, max_num_tokens=mnt, backend="triton", **kw)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), per_group(qsl.cpu(), pos.cpu(), [
        KVCacheGroup(g.block_table.cpu(), g.block_size, g.kv_cache_block_size, g.circular) for g in groups],
        mnt, **kw))


def _interpreter_main(n_random: int = 25) -> None:
    """Under TRITON_INTERPRET=1: the fused kernel on CPU tensors vs the per-group torch calls, and
    the single-group kernel (it shares the tail padding and the window read) on every group."""
    from cpmeta.cp.slot_mapping import make_params
    from cpmeta.gpu.slot_mapping_groups_triton import launch_slot_mapping_groups_kernel
    from cpmeta.gpu.slot_mapping_triton import launch_slot_mapping_kernel

    if not _interpreter_runs_loaded_loops():
        import numpy

        print(f"SKIP: the Triton {triton.__version__} interpreter cannot run loops over loaded bounds with "
              f"numpy {numpy.__version__} (the kernels run on CUDA: test_cuda_*)")
        return
    rng = random.Random(7)
    for i in range(n_random):
        qsl, pos, groups, mnt, kw = random_case(rng)
        params = [make_params(g.block_size, mnt, g.kv_cache_block_size, kw["cp_world_size"], kw["cp_rank"],
                              kw["cp_interleave"], -1, g.circular) for g in groups]
        out = torch.full((len(groups), mnt), 99, dtype=torch.int32)
        err = torch.zeros(1, dtype=torch.int32)
        launch_slot_mapping_groups_kernel(qsl, pos, [g.block_table for g in groups], out, err, params,
                                          tile=16, num_warps=1)
        assert int(err) == 0, (i, int(err))
        want = per_group(qsl, pos, groups, mnt, **kw)
        assert torch.equal(out, want), i
        for g, (grp, prm) in enumerate(zip(groups, params)):
            one = torch.full((mnt,), 99, dtype=torch.int32)
            launch_slot_mapping_kernel(qsl, pos, grp.block_table, one, err, prm, tile=16, num_warps=1)
            assert int(err) == 0 and torch.equal(one, want[g]), (i, g, int(err))
    # bad input: the same error bits from both kernels (a block index past the table; a
    # query_start_loc not starting at 0, decreasing, not ending at len(positions))
    E = cpmeta.cp.slot_mapping.SlotMappingError
    pos = torch.tensor([0, 9], dtype=torch.int32)
    table, prm = torch.zeros((1, 2), dtype=torch.int32), make_params(4, 4, None, 1, 0, 1, -1, False)
    for qsl, bits in (([0, 2], E.BLOCK_INDEX), ([1, 2], E.QUERY_START), ([0, 3], E.NUM_TOKENS),
                      ([0, 2, 1, 2], E.QUERY_ORDER)):
        qsl = torch.tensor(qsl, dtype=torch.int32)
        tab = table.expand(len(qsl) - 1, 2)
        for launch, out in ((lambda o, e: launch_slot_mapping_groups_kernel(qsl, pos, [tab], o, e, [prm], tile=16),
                             torch.zeros((1, 4), dtype=torch.int32)),
                            (lambda o, e: launch_slot_mapping_kernel(qsl, pos, tab, o, e, prm, tile=16),
                             torch.zeros(4, dtype=torch.int32))):
            err = torch.zeros(1, dtype=torch.int32)
            launch(out, err)
            want = int(bits) | int(E.BLOCK_INDEX)  # position 9 is past the 2-column table in every case
            assert int(err) == want, (qsl.tolist(), int(err), want)
    print(f"{n_random} interpreter cases passed")


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        _interpreter_main()
