"""The Prometheus exposition of ``bc.stats()`` (``cpmeta.broadcast.metrics.prometheus_collector``).

Imported only by that function: ``prometheus_client`` is the optional ``metrics`` extra, never a
core dependency. Values are read from every broadcaster when the registry is scraped.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as _Base

__all__ = ["Collector", "PREFIX"]

PREFIX = "cpmeta_broadcast"
_LABELS = ["rank", "group", "role"]
_QUANTILES = (("0.5", "p50"), ("0.99", "p99"))


class Collector(_Base):
    """``prometheus_client`` collector over ``broadcasters`` (see ``prometheus_collector``)."""

    def __init__(self, broadcasters: Any) -> None:
        self.broadcasters = list(broadcasters)

    def collect(self) -> Iterator[Metric]:
        steps = CounterMetricFamily(f"{PREFIX}_steps", "broadcasts completed", labels=_LABELS)
        nbytes = CounterMetricFamily(f"{PREFIX}_bytes", "payload bytes (tensors, values, layouts)",
                                     labels=_LABELS)
        layouts = CounterMetricFamily(f"{PREFIX}_layouts", "frames that carried a layout block",
                                      labels=_LABELS)
        refusals = CounterMetricFamily(f"{PREFIX}_refusals", "broadcast() calls that raised",
                                       labels=_LABELS + ["kind"])
        phase = Metric(f"{PREFIX}_phase_seconds", "time per broadcast phase (last steps)", "summary")
        lag = Metric(f"{PREFIX}_follower_lag_slots",
                     "ring slots the slowest follower had not read when a step began", "summary")
        arena_bytes = GaugeMetricFamily(f"{PREFIX}_arena_bytes", "bytes held by persistent arenas",
                                        labels=_LABELS + ["memory"])
        arenas = GaugeMetricFamily(f"{PREFIX}_arenas", "persistent arenas held", labels=_LABELS)
        for bc in self.broadcasters:
            s = bc.stats()
            lab = [str(s.rank), s.group, s.role]
            steps.add_metric(lab, s.steps)
            nbytes.add_metric(lab, s.bytes_total)
            layouts.add_metric(lab, s.layouts)
            for kind, n in s.refusals.items():
                refusals.add_metric(lab + [kind], n)
            for name in ("send", "wait", "land"):
                summ = getattr(s, name)
                if summ.n:  # a driver has no wait, a follower no send
                    _summary(phase, dict(zip(_LABELS, lab), phase=name), summ)
            if s.lag_slots is not None:
                _summary(lag, dict(zip(_LABELS, lab)), s.lag_slots)
            if s.arenas is not None:
                arena_bytes.add_metric(lab + ["host"], s.arenas["host_bytes"])
                arena_bytes.add_metric(lab + ["device"], s.arenas["device_bytes"])
                arenas.add_metric(lab, s.arenas["arenas"])
        yield from (steps, nbytes, layouts, refusals, phase, lag, arena_bytes, arenas)


def _summary(metric: Metric, labels: dict[str, str], s: Any) -> None:
    """Quantile samples, ``_sum`` and ``_count`` of one :class:`~.metrics.Summary`."""
    for q, attr in _QUANTILES:
        metric.add_sample(metric.name, {**labels, "quantile": q}, getattr(s, attr))
    metric.add_sample(metric.name + "_sum", labels, s.mean * s.n)
    metric.add_sample(metric.name + "_count", labels, s.n)
