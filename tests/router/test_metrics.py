"""The router's Prometheus metrics: names, bounded labels, and the dashboard that reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.pool import WorkerHandle, WorkerPool
from pdserve.router.prometheus import RouterMetrics
from pdserve.router.worker_gauges import worker_labels
from pdserve.v1 import generate_pb2

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


class _Pool:
    def __init__(self):
        self.workers = [
            WorkerHandle("prefill", "127.0.0.1:1", channel=None, total_kv_blocks=10, used_kv_blocks=4),
            WorkerHandle("decode", "127.0.0.1:2", channel=None, healthy=False),
        ]


def _families(m: RouterMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}


def test_observations_land_in_their_series():
    m = RouterMetrics(_Pool())
    m.token_arrival(30_000_000, first=True)
    m.token_arrival(5_000_000, first=False)
    t = generate_pb2.Timings(
        queue_ns=1_000_000, prefill_ns=2_000_000, kv_transfer_ns=3_000_000, kv_transfer_bytes=4096, decode_ns=4_000_000
    )
    m.finished(generate_pb2.FINISH_REASON_LENGTH, 0, t)
    m.finished(generate_pb2.FINISH_REASON_ABORT, 0, None)
    m.rejected("invalid")
    m.local_prefilled("prefill_busy")
    m.role_switched("prefill", "decode")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in _families(m).values() for s in f.samples}
    assert samples[("pdserve:local_prefills_total", (("reason", "prefill_busy"),))] == 1
    assert samples[("pdserve:local_prefills_total", (("reason", "short"),))] == 0
    assert samples[("pdserve:role_switches_total", (("from_role", "prefill"), ("to_role", "decode")))] == 1
    assert samples[("pdserve:role_switches_total", (("from_role", "decode"), ("to_role", "prefill")))] == 0
    assert samples[("pdserve:time_to_first_token_seconds_sum", ())] == 0.03
    assert samples[("pdserve:inter_token_latency_seconds_count", ())] == 1
    assert samples[("pdserve:kv_transfer_bytes_sum", ())] == 4096
    assert samples[("pdserve:request_prefill_time_seconds_count", ())] == 1  # the aborted one has no phases
    assert samples[("pdserve:e2e_request_latency_seconds_count", ())] == 2
    assert samples[("pdserve:requests_total", (("finish_reason", "abort"),))] == 1
    assert samples[("pdserve:requests_total", (("finish_reason", "stop"),))] == 0
    assert samples[("pdserve:kv_cache_usage_perc", (("role", "prefill"), ("worker", "prefill-0")))] == 0.4
    assert samples[("pdserve:worker_healthy", (("role", "decode"), ("worker", "decode-0")))] == 0
    assert not any(name.endswith("_created") for name, _ in samples)
    labels = {k for (_, ls) in samples for k, _ in ls}
    assert labels <= {"le", "finish_reason", "reason", "role", "worker", "stage", "from_role", "to_role"}  # no ids


def test_workers_are_labelled_by_role_and_index_never_by_address():
    ws = [
        WorkerHandle(role, f"10.0.0.{i}:5000{i}", channel=None)
        for i, role in enumerate(("prefill", "decode", "prefill", "decode", "decode"))
    ]
    assert worker_labels(ws) == ["prefill-0", "decode-0", "prefill-1", "decode-1", "decode-2"]
    assert worker_labels([WorkerHandle("colocated", "10.0.0.9:1", channel=None)] * 2) == ["colocated-0", "colocated-1"]


async def test_a_replacement_worker_keeps_the_label_of_the_one_it_replaces():
    pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"], [])  # nothing listens: polls fail
    try:
        m = RouterMetrics(pool)

        def healthy() -> dict:
            return {s.labels["worker"]: s.labels["role"] for s in _families(m)["pdserve:worker_healthy"].samples}

        assert healthy() == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
        await pool.replace("127.0.0.1:2", "127.0.0.1:4", "decode")
        assert [w.address for w in pool.workers] == ["127.0.0.1:1", "127.0.0.1:4", "127.0.0.1:3"]
        assert healthy() == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
        assert "127.0.0.1" not in m.exposition().decode()
    finally:
        await pool.close()


def test_rejection_reasons_are_a_bounded_set():
    m = RouterMetrics(_Pool())
    m.rejected("unauthenticated")
    text = m.exposition().decode()
    assert 'pdserve:requests_rejected_total{reason="unauthenticated"} 1.0' in text
    assert 'pdserve:requests_rejected_total{reason="overloaded"} 0.0' in text
    with pytest.raises(ValueError, match="unknown rejection reason"):
        m.rejected("bad key")


def test_two_routers_in_one_process_keep_their_own_counts():
    a, b = RouterMetrics(_Pool()), RouterMetrics(_Pool())
    a.rejected("unavailable")
    assert 'pdserve:requests_rejected_total{reason="unavailable"} 1.0' in a.exposition().decode()
    assert 'pdserve:requests_rejected_total{reason="unavailable"} 0.0' in b.exposition().decode()


def test_the_dashboard_reads_only_metrics_the_router_exports():
    exported = {s.name for f in _families(RouterMetrics(_Pool())).values() for s in f.samples}
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"pdserve:[a-z0-9_]+", e)}
    assert len(dash["panels"]) >= 8 and used
    assert used <= exported, used - exported


def test_the_api_docs_metrics_table_lists_every_metric_the_router_exports():
    api = (DASHBOARD.parent / "api.md").read_text()  # docs/api.md, section "## Metrics"
    start = api.index("\n## Metrics\n")
    end = api.find("\n## ", start + 1)
    table = api[start : end if end != -1 else len(api)]
    listed = set(re.findall(r"^\| `(pdserve:[a-z0-9_]+)` \|", table, re.M))
    exported = set()
    for f in _families(RouterMetrics(_Pool())).values():  # the parser names a counter without _total
        exported.add(f.name + "_total" if f.type == "counter" else f.name)
    assert exported == listed, (exported - listed, listed - exported)
