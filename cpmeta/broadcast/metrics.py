"""``MetadataBroadcaster.stats()``: counters and latency summaries of one rank's broadcasts.

Per step the broadcaster keeps, in preallocated rings of the last :data:`WINDOW` steps (no
allocation, a few list stores: the cost is measured in docs/metrics.md)::

    driver     send = broadcast() entry -> frame published (collect, frame, ring slot, collective)
               land = published -> return (own copy into its arena, H2D, values)
               lag  = ring slots the slowest same-host follower had not yet read when this step
                      began (``transport`` ``RingIO.backlog``; none on the process-group path)
    follower   wait = broadcast() entry -> the frame is here (parked or spinning in the ring, or
                      receiving it from the process group)
               land = frame here -> return (checks, copy into the arena or a fresh buffer, views)
    both       payload bytes (exact tensor bytes + values block + layout block), whether the frame
               carried a layout (the driver sent a new layout; the follower built its plan)

Totals count every step since construction; p50 / p99 / max / mean are over the window. A call
that raises is not a step: it is counted under ``refusals`` by kind (:func:`refusal_kind`).

``prometheus_collector(*broadcasters)`` exposes the same numbers to ``prometheus_client`` (the
optional ``metrics`` extra: ``pip install cpmeta[metrics]``) as ``cpmeta_broadcast_*`` metrics
labelled ``rank``, ``group`` and ``role``, read when scraped (nothing on the hot path).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

from cpmeta.transport.codec import CodecError
from cpmeta.transport.errors import PeerError

from .wire import ChecksumError, FrameMismatch, WireError

__all__ = ["WINDOW", "REFUSAL_KINDS", "Summary", "BroadcastStats", "BroadcastMetrics",
           "refusal_kind", "STATS_ROW", "format_table", "prometheus_collector"]

#: Steps whose latencies the percentiles are taken over (a power of two: the ring index is a mask).
WINDOW = 4096
_MASK = WINDOW - 1
#: What a refused ``broadcast()`` is counted as (``refusal_kind``).
REFUSAL_KINDS = ("input", "malformed", "checksum", "mismatch", "timeout", "peer", "other")


class Summary(NamedTuple):
    """One quantity over the last ``n`` steps (seconds, bytes or slots)."""

    n: int
    mean: float
    p50: float
    p99: float
    max: float

    @staticmethod
    def of(xs: list[float]) -> "Summary":
        """Nearest-rank percentiles: ``p50`` of ``[1, 2, 3, 4]`` is 3 (index ``int(0.5 * 4)``)."""
        if not xs:
            return Summary(0, 0.0, 0.0, 0.0, 0.0)
        s = sorted(xs)
        n = len(s)
        return Summary(n, sum(s) / n, s[min(n - 1, int(0.5 * n))], s[min(n - 1, int(0.99 * n))], s[-1])


@dataclass(frozen=True)
class BroadcastStats:
    """What ``bc.stats()`` returns (module docstring). Times in seconds.

    ``send`` is the driver's phase, ``wait`` the followers' (the other one is an empty summary);
    ``lag_slots`` is the driver's on the shared-memory path, else ``None``; ``arenas`` the
    persistent arenas' counters (``None`` without ``persistent_outputs``): ``layouts``,
    ``arenas``, ``host_bytes``, ``device_bytes``, ``persisted`` / ``fresh`` steps, ``created`` /
    ``evicted`` arenas.
    """

    rank: int
    group: str
    role: str  # "driver" or "follower"
    steps: int
    bytes_total: int
    layouts: int  # frames that carried a layout block
    refusals: dict[str, int]
    bytes_per_step: Summary
    send: Summary
    wait: Summary
    land: Summary
    lag_slots: Optional[Summary] = None
    slot_bytes: int = 0  # bytes of one ring slot (lag_slots * slot_bytes = bytes behind)
    arenas: Optional[dict[str, int]] = field(default=None)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def row(self) -> list[float]:
        """The numbers of :data:`STATS_ROW`, for gathering every rank's stats as one tensor."""
        lag = self.lag_slots.max if self.lag_slots is not None else float("nan")
        first = self.send if self.role == "driver" else self.wait
        a = self.arenas or {}
        return [float(self.rank), float(self.steps), self.bytes_per_step.mean, float(self.layouts),
                first.p50 * 1e6, first.p99 * 1e6, self.land.p50 * 1e6, self.land.p99 * 1e6, lag,
                float(sum(self.refusals.values())), float(a.get("arenas", 0)),
                float(a.get("host_bytes", 0))]


#: Columns of :meth:`BroadcastStats.row` (``send``: the driver's send, a follower's wait).
STATS_ROW = ("rank", "steps", "bytes/step", "layouts", "send|wait p50 us", "send|wait p99 us",
             "land p50 us", "land p99 us", "lag max slots", "refused", "arenas", "arena bytes")


def format_table(rows: list[list[float]]) -> str:
    """Every rank's :meth:`BroadcastStats.row` as a text table (rank 0 is the driver)."""
    head = ["rank", "steps", "bytes/step", "layouts", "send/wait p50", "p99", "land p50", "p99",
            "lag max", "refused", "arenas", "arena MiB"]
    out = ["broadcast metrics (bc.stats(); times in us; rank 0 sends, the others wait; lag: ring "
           "slots behind)", " ".join(f"{h:>13}" for h in head)]
    for r in rows:
        cells = [f"{int(r[0])}", f"{int(r[1])}", f"{r[2]:.0f}", f"{int(r[3])}"] + \
            [f"{x:.1f}" for x in r[4:8]] + ["-" if r[8] != r[8] else f"{int(r[8])}",
                                             f"{int(r[9])}", f"{int(r[10])}", f"{r[11] / 2**20:.2f}"]
        out.append(" ".join(f"{c:>13}" for c in cells))
    return "\n".join(out)


def refusal_kind(e: BaseException) -> str:
    """What a ``broadcast()`` that raised ``e`` is counted as: ``timeout`` (a wait ran out),
    ``peer`` (a peer died or closed), ``checksum`` / ``malformed`` / ``mismatch`` (the frame: its
    crc32, its contents, another version or schema; the channel re-raises those as a
    ``RuntimeError`` whose context is the codec's error), ``input`` (a ``TypeError`` /
    ``ValueError`` about this rank's own arguments), else ``other``."""
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, PeerError):
        return "peer"
    cause = e.__context__ if isinstance(e, RuntimeError) else None
    if isinstance(cause, ChecksumError):
        return "checksum"
    if isinstance(cause, FrameMismatch):
        return "mismatch"
    if isinstance(cause, (WireError, CodecError, KeyError, TypeError, ValueError, IndexError)):
        return "malformed"
    if isinstance(e, (TypeError, ValueError)):
        return "input"
    return "other"


class BroadcastMetrics:
    """The per-step rings and counters behind ``bc.stats()`` (module docstring)."""

    __slots__ = ("steps", "bytes_total", "layouts", "refusals", "first", "second", "nbytes", "lag")

    def __init__(self) -> None:
        self.steps = self.bytes_total = self.layouts = 0
        self.refusals = dict.fromkeys(REFUSAL_KINDS, 0)
        self.first = [0.0] * WINDOW  # driver: send; follower: wait
        self.second = [0.0] * WINDOW  # land
        self.nbytes = [0] * WINDOW
        self.lag: list[int] = []  # the driver's ring backlog per step (filled on the ring path)

    def step(self, t0: float, t1: float, t2: float, nbytes: int, layout: bool) -> None:
        """One completed broadcast: entered at ``t0``, frame published / here at ``t1``, returned
        at ``t2`` (``time.perf_counter()``)."""
        i = self.steps & _MASK
        self.first[i] = t1 - t0
        self.second[i] = t2 - t1
        self.nbytes[i] = nbytes
        self.steps += 1
        self.bytes_total += nbytes
        self.layouts += layout

    def backlog(self, slots: int) -> None:
        """Driver: the ring backlog seen when this step began (before :meth:`step` counts it)."""
        if not self.lag:
            self.lag = [0] * WINDOW
        self.lag[self.steps & _MASK] = slots

    def refused(self, e: BaseException) -> None:
        self.refusals[refusal_kind(e)] += 1

    def stats(self, rank: int, group: str, is_src: bool, slot_bytes: int,
              arenas: Optional[dict[str, int]]) -> BroadcastStats:
        n = min(self.steps, WINDOW)
        first, second = Summary.of(self.first[:n]), Summary.of(self.second[:n])
        empty = Summary.of([])
        lag = Summary.of([float(x) for x in self.lag[:n]]) if self.lag else None
        return BroadcastStats(
            rank=rank, group=group, role="driver" if is_src else "follower", steps=self.steps,
            bytes_total=self.bytes_total, layouts=self.layouts, refusals=dict(self.refusals),
            bytes_per_step=Summary.of([float(x) for x in self.nbytes[:n]]),
            send=first if is_src else empty, wait=empty if is_src else first, land=second,
            lag_slots=lag, slot_bytes=slot_bytes if lag is not None else 0, arenas=arenas)


def prometheus_collector(*broadcasters: Any) -> Any:
    """A ``prometheus_client`` collector of these broadcasters' stats, read at scrape time::

        from prometheus_client import REGISTRY
        REGISTRY.register(cpmeta.broadcast.metrics.prometheus_collector(bc))

    Metrics (labels ``rank``, ``group``, ``role``): ``cpmeta_broadcast_steps_total``,
    ``_bytes_total``, ``_layouts_total``, ``_refusals_total`` (+ ``kind``), summaries
    ``cpmeta_broadcast_phase_seconds`` (+ ``phase``: send, wait, land; quantiles 0.5, 0.99 over
    the window, ``_sum`` / ``_count`` over it) and ``cpmeta_broadcast_follower_lag_slots``
    (driver), gauges ``cpmeta_broadcast_arena_bytes`` (+ ``memory``: host, device) and
    ``cpmeta_broadcast_arenas``. ``ImportError`` (naming the extra) without prometheus_client.
    """
    try:
        from .prometheus import Collector
    except ImportError as e:
        raise ImportError("prometheus_collector needs prometheus_client: pip install "
                          "'cpmeta[metrics]'") from e
    return Collector(broadcasters)
