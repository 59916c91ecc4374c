"""MetadataBroadcaster options on real gloo processes: ``group_src`` over a 2-D DeviceMesh,
``out=`` buffers, the cached layout (ids, unknown id), ``begin_step`` and the opt-in checksum."""

from __future__ import annotations

import pytest
import torch

from multiproc import run_ranks
from test_broadcast_multirank import _expect_same, _random_case


def _mesh(rank: int, world: int) -> list[int]:
    import cpmeta
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
    cp_rank, group_id = mesh.get_local_rank("cp"), rank // 2
    seen = []
    with cpmeta.MetadataBroadcaster(group=mesh.get_group("cp"), group_src=0, timeout=30) as bc:
        for i in range(3):
            cfg, mine = _random_case(100 + group_id, i, True)
            _, other = _random_case(100 + (1 - group_id), i, True)
            bc.begin_step()
            got = bc.broadcast(mine if cp_rank == 0 else None)
            _expect_same(mine, got, cfg, f"cp group {group_id} step {i}")
            local = cpmeta.prepare_for_mirror_cp(got, cp_rank, 2)
            ref = cpmeta.prepare_for_mirror_cp(mine, cp_rank, 2)
            _expect_same(ref, local, cfg, f"mirror cp_rank {cp_rank}")
            if other.total_q != mine.total_q or not torch.equal(other.positions, mine.positions):
                seen.append(1)  # the other group's metadata differs: ours is not the other's
    return [group_id, cp_rank, len(seen)]


def test_group_src_over_a_2d_device_mesh() -> None:
    out = run_ranks(_mesh, 4, timeout=180)
    assert [o[:2] for o in out] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert all(o[2] == 3 for o in out)


def _src_args(rank: int, world: int) -> list[str]:
    import cpmeta

    errs = []
    for kw in ({"src": 0, "group_src": 0}, {"group_src": 2}, {"src": 5}):
        try:
            cpmeta.MetadataBroadcaster(**kw)
            errs.append("accepted")
        except ValueError as e:
            errs.append(str(e))
    return errs


def test_src_and_group_src_are_checked() -> None:
    errs = run_ranks(_src_args, 2, timeout=120)[0]
    assert "not both" in errs[0] and "group_src" in errs[1] and "not in the group" in errs[2], errs


def _out_buffers(rank: int, world: int) -> int:
    import cpmeta

    n = 0
    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
        for i in range(4):
            cfg, local = _random_case(7, i, i % 2 == 0)
            aliased = local.replace(positions_cp=local.positions)
            bufs: dict = {}
            memo: dict = {}  # the buffers alias where the metadata does (positions_cp)
            for name in local.field_names():
                v = getattr(aliased, name)
                if isinstance(v, torch.Tensor):
                    if id(v) not in memo:
                        memo[id(v)] = torch.full((v.shape[0] + 5, *v.shape[1:]) if v.dim() else (),
                                                 7, dtype=v.dtype)
                    bufs[name] = memo[id(v)]
                elif isinstance(v, dict) and any(isinstance(x, torch.Tensor) for x in v.values()):
                    bufs[name] = {k: torch.zeros((x.shape[0] + 3, *x.shape[1:]), dtype=x.dtype)
                                  for k, x in v.items() if isinstance(x, torch.Tensor)}
            out = aliased.replace(**bufs)
            got = bc.broadcast(aliased if rank == 0 else None, out=out)
            _expect_same(aliased, got, cfg, f"out= case {i}")
            for name, b in bufs.items():
                g = getattr(got, name)
                if isinstance(b, dict):
                    assert all(g[k].data_ptr() == b[k].data_ptr() for k in b), name
                else:
                    assert g.data_ptr() == b.data_ptr(), name
            n += 1
        # a buffer too small is an error naming the path
        cfg, local = _random_case(7, 9, False)
        small = local.replace(positions=torch.zeros(0, dtype=local.positions.dtype))
        try:
            bc.broadcast(local if rank == 0 else None, out=small)
        except ValueError as e:
            assert "positions" in str(e)
            n += 1
    return n


def test_out_buffers_receive_in_place() -> None:
    assert run_ranks(_out_buffers, 2, timeout=180) == [5, 5]


def _layout_cache(rank: int, world: int) -> list:
    import cpmeta
    import cpmeta.broadcast.wire as bb  # frame_crc: the driver seals frames with it

    res = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
        cfg, local = _random_case(11, 0, False)
        for _ in range(3):
            _expect_same(local, bc.broadcast(local if rank == 0 else None), cfg, "same layout")
        res.append(len(bc._ch.reader._plans) if rank else len(bc._ch.writer._layouts))
        if rank == 1:
            bc._ch.reader._plans.clear()  # as if this rank had joined late
        try:
            bc.broadcast(local if rank == 0 else None)
            res.append("ok")
        except RuntimeError as e:
            res.append(str(e))
        # checksum: a frame whose crc does not match is refused, naming the rank
        bc.checksum = bc._ch.checksum = bc._ch.reader.require_crc = True
        real = bb.frame_crc
        if rank == 0:
            bb.frame_crc = lambda view: real(view) ^ 1
        try:
            bc.broadcast(local if rank == 0 else None)
            res.append("ok")
        except RuntimeError as e:
            res.append(str(e))
        bb.frame_crc = real
        cfg, other = _random_case(11, 1, True)
        _expect_same(other, bc.broadcast(other if rank == 0 else None), cfg, "checksummed")
    return res


def test_layout_sent_once_unknown_id_and_checksum() -> None:
    drv, fol = run_ranks(_layout_cache, 2, timeout=120)
    assert drv == [1, "ok", "ok"]
    assert fol[0] == 1
    assert "rank 1" in fol[1] and "layout id" in fol[1] and "never received" in fol[1], fol[1]
    assert "rank 1" in fol[2] and "crc32" in fol[2], fol[2]


@pytest.mark.parametrize("env", [{"CPMETA_CHECKSUM": "1"}, {"CPMETA_CHECKSUM": "1", "CPMETA_FORCE_REMOTE": "1"}])
def test_checksum_env_round_trip(env: dict) -> None:
    def_env = dict(env)
    assert run_ranks(_checksummed, 2, env=def_env, timeout=120) == [True, True]


def _checksummed(rank: int, world: int) -> bool:
    import cpmeta

    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
        for i in range(3):
            cfg, local = _random_case(13, i, i == 1)
            _expect_same(local, bc.broadcast(local if rank == 0 else None), cfg, "crc")
        return bc.checksum


def _foreign_device(rank: int, world: int) -> list[str]:
    """The driver's metadata holds a tensor on the ``meta`` device (no bytes to send), on both
    tensor paths: the driver's error names the field, the follower's call raises it in step, and
    the next step goes through."""
    import cpmeta

    seen = []
    for path in ("packed", "collective"):
        with cpmeta.MetadataBroadcaster(src=0, timeout=30, tensor_path=path) as bc:
            cfg, local = _random_case(7, 3, False)
            bad = local.replace(positions=torch.empty(local.positions.shape, dtype=local.positions.dtype,
                                                     device="meta"))
            try:
                bc.broadcast(bad if rank == 0 else None)
                seen.append("accepted")
            except ValueError as e:
                seen.append(str(e))
            got = bc.broadcast(local if rank == 0 else None)
            _expect_same(local, got, cfg, f"{path}: the step after the refused one")
    return seen


def test_a_tensor_on_another_device_is_refused_naming_its_field() -> None:
    for rank, seen in enumerate(run_ranks(_foreign_device, 2, timeout=120)):
        for msg in seen:
            assert "positions: a tensor on meta cannot be broadcast" in msg, (rank, msg)
