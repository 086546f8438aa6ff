"""Prometheus metrics of the remote tier, read from its counters at scrape time (one source of
truth: the same figures `kvctl status` shows)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

P = "kvagentd_remote_"


class RemoteCollector(Collector):
    """Collects from `status()` (the remote service's status dict)."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        link, wb = st.get("link", {}), st.get("write_behind", {})
        reads, sessions = st.get("reads", {}), st.get("sessions", {})
        up = GaugeMetricFamily(P + "up", "1 while the remote store answers, 0 while it is down")
        up.add_metric([], 1.0 if link.get("state") == "up" else 0.0)
        yield up
        yield _counter("downs", "Times the remote went down (connection error or timeout)",
                       link.get("downs", 0))
        yield _counter("full", "Writes the remote refused for memory (maxmemory)",
                       link.get("full", 0))
        r = CounterMetricFamily(P + "block_reads", "Block reads from the remote by result",
                                labels=["result"])
        for label, key in (("hit", "remote_hits"), ("missing", "remote_missing"),
                           ("corrupt", "remote_corrupt"), ("unavailable", "remote_unavailable")):
            r.add_metric([label], float(reads.get(key, 0)))
        yield r
        yield _counter("lookups", "Lookups of blocks past the local prefix", reads.get("lookups", 0))
        yield _counter("lookup_found_blocks", "Blocks found by lookups",
                       reads.get("lookup_found", 0))
        yield _counter("written_blocks", "Block records written behind", wb.get("written", 0))
        yield _counter("written_bytes", "Bytes of block records written behind",
                       wb.get("written_bytes", 0))
        yield _counter("write_dropped", "Writes dropped: queue budget spent, or left at stop",
                       wb.get("dropped", 0))
        yield _counter("write_failed", "Writes the remote refused", wb.get("failed", 0))
        g = GaugeMetricFamily(P + "write_queue_bytes", "Bytes waiting in the write-behind queue")
        g.add_metric([], float(wb.get("queued_bytes", 0)))
        yield g
        if sessions:
            yield _counter("sessions_published", "Session manifests written",
                           sessions.get("published", 0))
            yield _counter("sessions_fenced", "Session writes refused: another box holds it",
                           sessions.get("fenced", 0))


def _counter(name: str, doc: str, value: object) -> CounterMetricFamily:
    c = CounterMetricFamily(P + name, doc)
    c.add_metric([], float(value))  # type: ignore[arg-type]
    return c


def register(registry: CollectorRegistry | None, status: Callable[[], dict[str, Any]]) -> None:
    if registry is not None:
        registry.register(RemoteCollector(status))
