"""A follower's figures as Prometheus metrics (needs ``torchrec_cnr[metrics]``, that is
``prometheus-client``).

The collector reads the follower when scraped: nothing runs between scrapes.

Example::

    from prometheus_client import CollectorRegistry, generate_latest, start_http_server
    from torchrec_cnr.serving.metrics import FollowerCollector

    registry = CollectorRegistry()
    registry.register(FollowerCollector(follower))
    start_http_server(9100, registry=registry)   # or: generate_latest(registry)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchrec_cnr.serving.follower import Follower

__all__ = ["FollowerCollector", "metrics_text"]


class FollowerCollector:
    """Collects one follower's figures, labelled ``root``.

    Gauges: ``served_step``, ``pinned`` and the last update's ``last_lag_seconds``,
    ``last_update_seconds``, ``last_blocked_seconds``, ``last_update_rows``,
    ``last_update_bytes`` and ``last_update_requests``. Counters (``_total``): ``updates``,
    ``rows``, ``read_bytes``, ``blocked_seconds``, ``refused_updates`` (the accept gate's)
    and ``failed_polls``; ``polls``, ``idle_polls`` (nothing new found),
    ``idle_poll_requests`` and ``requests`` (every request to the root).
    """

    def __init__(self, follower: Follower, prefix: str = "cnr_follower") -> None:
        self.follower = follower
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        f, p = self.follower, self.prefix
        label = [f.storage.url]
        reports = list(f.reports)
        last = reports[-1] if reports else None

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{p}_{name}", doc, labels=["root"])
            if value is not None:
                g.add_metric(label, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{p}_{name}", doc, labels=["root"])
            c.add_metric(label, float(value))
            return c

        def of(attr: str) -> float | None:
            return None if last is None else float(getattr(last, attr))

        yield gauge("served_step", "The step served.", f.step)
        yield gauge("pinned", "1 while pinned (polls keep the served step).", int(f.pinned))
        yield gauge("last_lag_seconds", "Last update: from its commit to served.", of("lag_s"))
        yield gauge("last_update_seconds", "Last update: from the poll to served.", of("seconds"))
        yield gauge("last_blocked_seconds", "Last update: serving blocked.", of("blocked_s"))
        yield gauge("last_update_rows", "Last update: rows read and applied.", of("rows"))
        yield gauge("last_update_bytes", "Last update: bytes read.", of("bytes_read"))
        yield gauge("last_update_requests", "Last update: requests made.", of("requests"))
        yield counter("updates", "Updates applied.", len(reports))
        yield counter("rows", "Rows read and applied.", sum(r.rows for r in reports))
        yield counter("read_bytes", "Bytes read by updates.", sum(r.bytes_read for r in reports))
        yield counter("blocked_seconds", "Serving blocked by updates.",
                      sum(r.blocked_s for r in reports))  # fmt: skip
        yield counter("refused_updates", "Updates the accept gate refused.", len(f.refused))
        yield counter("failed_polls", "Polls that failed.", f.failures)
        yield counter("polls", "Polls made.", f.polls)
        yield counter("idle_polls", "Polls that found nothing new.", f.idle_polls)
        yield counter("idle_poll_requests", "Requests of those polls.", f.idle_requests)
        yield counter("requests", "Requests made to the root.", f.storage.requests)


def metrics_text(follower: Follower) -> str:
    """The follower's metrics in Prometheus's text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(FollowerCollector(follower))  # type: ignore[arg-type]
    return generate_latest(registry).decode()
