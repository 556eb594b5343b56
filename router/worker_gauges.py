"""The router's per-worker Prometheus gauges and the ``worker`` label they carry.

:class:`WorkerGauges` is a collector that reads each worker's running and waiting sequences, KV
cache usage and health from the pool's latest GetStats poll at scrape time;
:func:`worker_labels` names each worker by role and position (``decode-0``), so a restarted
worker's series keep their labels. :class:`~pdserve.router.prometheus.RouterMetrics` registers the
collector in the router's registry.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily


def worker_labels(workers) -> list[str]:
    """The ``worker`` label of each of ``workers`` (``WorkerHandle``s, in pool order): its role and its
    position among that role's workers, ``prefill-0``, ``decode-1``, ``colocated-0`` (``switchable-0``
    for switchable workers, whose role is only in the ``role`` label). ``WorkerPool.replace``
    keeps a replacement at the position of the worker it replaces, so the label outlives the address."""
    seen: dict[str, int] = {}
    labels = []
    for w in workers:
        kind = "switchable" if w.switchable else w.role  # a switchable worker's role changes, its label not
        index = seen.get(kind, 0)
        seen[kind] = index + 1
        labels.append(f"{kind}-{index}")
    return labels


class WorkerGauges:
    """Collector of the per-worker gauges, from the pool's view at scrape time."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
        labels = ["role", "worker"]
        running = GaugeMetricFamily(
            "pdserve:num_requests_running", "Sequences in the worker's running batch.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "pdserve:num_requests_waiting",
            "Sequences waiting for prefill or for their KV cache on the worker.",
            labels=labels,
        )
        usage = GaugeMetricFamily(
            "pdserve:kv_cache_usage_perc", "Fraction of the worker's KV cache blocks in use (1 = full).", labels=labels
        )
        healthy = GaugeMetricFamily(
            "pdserve:worker_healthy",
            "1 when the worker answers its stats polls and takes requests, else 0.",
            labels=labels,
        )
        workers = list(self.pool.workers)
        for w, label in zip(workers, worker_labels(workers)):
            key = [w.role, label]
            running.add_metric(key, w.num_running)
            waiting.add_metric(key, w.num_waiting)
            usage.add_metric(key, w.used_kv_blocks / w.total_kv_blocks if w.total_kv_blocks else 0.0)
            healthy.add_metric(key, 1.0 if w.healthy else 0.0)
        return [running, waiting, usage, healthy]
