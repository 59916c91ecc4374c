"""``bc.stats()`` counted on a known trace (issue 32 item 5), the refusal kinds, the launch table
and the Prometheus exposition (where ``prometheus_client`` imports)."""

from __future__ import annotations

import pytest
import torch

from multiproc import run_ranks

#: (positions length, is_prompt) per step; a prompt step also sets max_seqlen_k (another value
#: path: another layout), so two layouts are sent, each with its own arena
TRACE = [(4, False), (4, False), (6, True), (4, False), (6, True)]


def _md(n: int, is_prompt: bool, v: int):
    import cpmeta

    return cpmeta.InputMetadata(is_prompt=is_prompt, num_seqs=1, total_q=n, max_seqlen_q=n,
                                max_seqlen_k=n if is_prompt else None,
                                positions=torch.arange(v, v + n, dtype=torch.int32))


def _expected_bytes() -> tuple[int, int]:
    """Payload bytes of TRACE as the frames carry them: exact tensor bytes + values block, + the
    layout block on each layout's first step; and the number of layouts."""
    from cpmeta.broadcast.collect import collect
    from cpmeta.broadcast.plan import Plan
    from cpmeta.broadcast.schema import INPUT_METADATA
    from cpmeta.broadcast.wire import FrameWriter
    from cpmeta.transport.codec import encode_body

    writer = FrameWriter(INPUT_METADATA, Plan)
    total, layouts = 0, 0
    for i, (n, p) in enumerate(TRACE):
        key, tensors, values = collect(_md(n, p, i))
        lid, _, block = writer.layout(key)
        if block:
            writer.sent(key, lid)  # (its frame reached the followers)
        layouts += bool(block)
        total += sum(t.numel() * t.element_size() for t in tensors) + len(encode_body(values)) + len(block)
    return total, layouts


def _counted(rank: int, world: int, persistent: bool) -> dict:
    import cpmeta

    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=persistent,
                                    metrics=True) as bc:
        for i, (n, p) in enumerate(TRACE):
            got = bc.broadcast(_md(n, p, i) if rank == 0 else None)
            assert got.positions.tolist() == list(range(i, i + n))
        if rank == 0:  # refused calls: not steps, counted by kind (the driver sends an abort
            # frame, which the followers' own refused call consumes: every rank stays in step)
            with pytest.raises(TypeError):
                bc.broadcast("not metadata")
        else:
            with pytest.raises(ValueError):
                bc.broadcast(_md(2, False, 0))  # a follower passing metadata
        st = bc.stats()
        row = st.row()
    with cpmeta.MetadataBroadcaster(src=0, timeout=60) as plain:  # the default: nothing kept
        plain.broadcast(_md(3, False, 0) if rank == 0 else None)
        with pytest.raises(RuntimeError, match="metrics=True"):
            plain.stats()
    return dict(st=st.as_dict(), row=row)


@pytest.mark.parametrize("persistent", [False, True])
def test_stats_count_a_known_trace(persistent: bool) -> None:
    from cpmeta.broadcast.metrics import STATS_ROW, format_table

    want_bytes, want_layouts = _expected_bytes()
    res = run_ranks(_counted, 3, persistent, timeout=120)
    for rank, r in enumerate(res):
        st = r["st"]
        assert st["rank"] == rank and st["role"] == ("driver" if rank == 0 else "follower")
        assert st["steps"] == len(TRACE) and st["layouts"] == want_layouts == 2
        assert st["bytes_total"] == want_bytes, (rank, st["bytes_total"], want_bytes)
        assert st["bytes_per_step"][0] == len(TRACE)  # n samples
        assert st["refusals"]["input"] == 1 and sum(st["refusals"].values()) == 1
        assert st["land"][0] == len(TRACE)
        first, other = ("send", "wait") if rank == 0 else ("wait", "send")
        assert st[first][0] == len(TRACE) and st[other][0] == 0
        assert st[first][3] >= st[first][2] >= 0  # p99 >= p50
        if rank == 0:  # same-host followers: the ring backlog sampled once per step
            assert st["lag_slots"][0] == len(TRACE) and st["slot_bytes"] > 0
        else:
            assert st["lag_slots"] is None
        if persistent:  # layouts 4 and 6 persisted from their first step: 2 arenas, all steps
            a = st["arenas"]
            assert (a["layouts"], a["arenas"], a["persisted"], a["fresh"], a["created"]) == (2, 2, 5, 0, 2)
            assert a["host_bytes"] == 16 + 32 and a["device_bytes"] == 0  # regions: int32 [4], [6]
        else:
            assert st["arenas"] is None
        assert len(r["row"]) == len(STATS_ROW)
    table = format_table([r["row"] for r in res])
    assert table.count("\n") == 1 + 3 and " 5 " in table


def test_refusal_kinds() -> None:
    from cpmeta.broadcast.metrics import refusal_kind
    from cpmeta.broadcast.wire import ChecksumError, FrameMismatch, WireError
    from cpmeta.transport.errors import PeerError

    def wrapped(inner: BaseException) -> RuntimeError:  # as FrameChannel.receive re-raises
        try:
            try:
                raise inner
            except BaseException:
                raise RuntimeError("rank 1: malformed message") from None
        except RuntimeError as e:
            return e

    assert refusal_kind(wrapped(ChecksumError("crc"))) == "checksum"
    assert refusal_kind(wrapped(WireError("bad"))) == "malformed"
    assert refusal_kind(wrapped(FrameMismatch("v7"))) == "mismatch"
    assert refusal_kind(wrapped(ValueError("x"))) == "malformed"
    assert refusal_kind(TimeoutError("rank 2 lags")) == "timeout"
    assert refusal_kind(PeerError("rank 2 died")) == "peer"
    assert refusal_kind(TypeError("src: expected InputMetadata")) == "input"
    assert refusal_kind(RuntimeError("broadcast() after close()")) == "other"


def _scraped(rank: int, world: int) -> str:
    import cpmeta
    from cpmeta.broadcast.metrics import prometheus_collector
    from prometheus_client import CollectorRegistry, generate_latest

    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True, metrics=True) as bc:
        for i, (n, p) in enumerate(TRACE):
            bc.broadcast(_md(n, p, i) if rank == 0 else None)
        reg = CollectorRegistry()
        reg.register(prometheus_collector(bc))
        return generate_latest(reg).decode()


def test_prometheus_exposition() -> None:
    pytest.importorskip("prometheus_client")
    drv, fol = run_ranks(_scraped, 2, timeout=120)
    lab = 'group="{g}",rank="{r}",role="{role}"'
    g = drv.split('cpmeta_broadcast_steps_total{group="')[1].split('"')[0]
    assert f'cpmeta_broadcast_steps_total{{{lab.format(g=g, r=0, role="driver")}}} 5.0' in drv
    assert f'cpmeta_broadcast_steps_total{{{lab.format(g=g, r=1, role="follower")}}} 5.0' in fol
    assert f'cpmeta_broadcast_layouts_total{{{lab.format(g=g, r=0, role="driver")}}} 2.0' in drv
    assert 'cpmeta_broadcast_phase_seconds{group=' in drv and 'phase="send",quantile="0.99"' in drv
    assert 'phase="wait",quantile="0.5"' in fol and 'phase="send"' not in fol
    assert 'cpmeta_broadcast_phase_seconds_count{' in drv
    assert 'cpmeta_broadcast_follower_lag_slots_count{' in drv and "follower_lag_slots_count{" not in fol
    assert f'cpmeta_broadcast_arena_bytes{{group="{g}",memory="host",rank="1",role="follower"}} 48.0' in fol
    assert f'cpmeta_broadcast_refusals_total{{group="{g}",kind="checksum",rank="0",role="driver"}} 0.0' in drv
