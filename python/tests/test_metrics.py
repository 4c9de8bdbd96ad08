"""The Prometheus endpoint (gmlake.metrics) over a statistics stub fed with a real stats JSON
(data/stats-sim.json: the allocator on a simulated device after one stitch), scraped over
HTTP. No GPU, no torch."""

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

PYDIR = Path(__file__).resolve().parents[1]
if os.environ.get("GMLAKE_TEST_INSTALLED", "") in ("", "0"):
    sys.path.insert(0, str(PYDIR))

import gmlake  # noqa: E402
from gmlake import metrics  # noqa: E402

prom = pytest.importorskip("prometheus_client", reason="prometheus-client not installed (pip install 'gmlake[metrics]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

STATS = json.loads((Path(__file__).parent / "data" / "stats-sim.json").read_text())
EMPTY = {k: 0 for k in STATS}  # a device not used yet (gmlake.initialized 0)


class Stub:
    def __init__(self):
        self.calls = []

    def __call__(self, device):
        self.calls.append(device)
        if device == 0:
            return dict(STATS)
        if device == 1:
            return dict(EMPTY)
        raise RuntimeError("device lost")


@pytest.fixture
def server():
    stub = Stub()
    s = gmlake.serve_metrics(port=0, stats_fn=stub, devices_fn=lambda: [0, 1])
    s.stub = stub
    yield s
    metrics.stop_metrics()


def scrape(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return text, out


def v(samples, name, device, **labels):
    return samples[(name, tuple(sorted(dict(labels, device=str(device)).items())))]


def test_a_scrape_reports_every_metric_per_device(server):
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
    text, m = scrape(server.url)
    assert v(m, "gmlake_reserved_bytes", 0) == STATS["reserved_bytes.all.current"] == 402653184
    assert v(m, "gmlake_active_bytes", 0) == STATS["active_bytes.all.current"]
    assert v(m, "gmlake_allocated_bytes", 0) == STATS["allocated_bytes.all.current"]
    assert v(m, "gmlake_cached_bytes", 0) == STATS["gmlake.cached_bytes"]
    assert v(m, "gmlake_largest_free_block_bytes", 0) == STATS["gmlake.largest_free_block"] > 0
    assert v(m, "gmlake_fragmentation_ratio", 0) == pytest.approx(1 - 306184192 / 402653184)
    assert v(m, "gmlake_free_fragmentation_ratio", 0) == pytest.approx(1 - 25165824 / 96468992)
    assert v(m, "gmlake_stitches_total", 0) == 1
    assert v(m, "gmlake_pages_stitched_total", 0) == 50
    assert v(m, "gmlake_driver_calls_total", 0, kind="map") == 242
    assert v(m, "gmlake_driver_calls_total", 0, kind="create_physical") == 192
    # The calls' host time, in seconds (the statistic is in nanoseconds).
    assert v(m, "gmlake_driver_seconds_total", 0) == pytest.approx(STATS["gmlake.driver_ns"] * 1e-9)
    assert STATS["gmlake.driver_ns"] > 0
    assert v(m, "gmlake_ooms_total", 0) == 0
    assert v(m, "gmlake_alloc_retries_total", 0) == 0
    assert v(m, "gmlake_debug_canary_errors_total", 0) == 0
    assert v(m, "gmlake_initialized", 0) == 1
    # A device without allocations yet: zeros, and ratios of 0 (no division by zero).
    assert v(m, "gmlake_reserved_bytes", 1) == 0
    assert v(m, "gmlake_fragmentation_ratio", 1) == 0
    assert v(m, "gmlake_free_fragmentation_ratio", 1) == 0
    assert v(m, "gmlake_initialized", 1) == 0
    assert "# TYPE gmlake_stitches_total counter" in text
    assert "# TYPE gmlake_reserved_bytes gauge" in text


def test_one_stats_read_per_device_per_scrape(server):
    server.stub.calls.clear()
    scrape(server.url)
    assert server.stub.calls == [0, 1]
    scrape(server.url)
    assert server.stub.calls == [0, 1, 0, 1]


def test_a_device_that_cannot_be_read_is_flagged_and_the_others_served():
    metrics.stop_metrics()
    s = gmlake.serve_metrics(port=0, stats_fn=Stub(), devices_fn=lambda: [0, 2])
    try:
        _, m = scrape(s.url)
        assert v(m, "gmlake_stats_error", 2) == 1
        assert v(m, "gmlake_stats_error", 0) == 0
        assert v(m, "gmlake_reserved_bytes", 0) == 402653184
        assert ("gmlake_reserved_bytes", (("device", "2"),)) not in m
    finally:
        metrics.stop_metrics()


def test_a_second_server_is_refused(server):
    with pytest.raises(RuntimeError, match="already runs in this process at http://127.0.0.1:"):
        gmlake.serve_metrics(port=0)
    metrics.stop_metrics()
    again = gmlake.serve_metrics(port=0, stats_fn=Stub(), devices_fn=lambda: [0])
    assert scrape(again.url)[1][("gmlake_stitches_total", (("device", "0"),))] == 1


def test_a_port_in_use_is_a_clear_error():
    metrics.stop_metrics()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}: the port is in use"):
            gmlake.serve_metrics(port=port)
    assert metrics._server is None


@pytest.mark.parametrize("port", [-1, 65536, 100000, "http", 1.5, True])
def test_invalid_ports_are_refused(port):
    with pytest.raises(ValueError, match="invalid metrics port"):
        gmlake.serve_metrics(port=port)


def test_without_gmlake_enabled_the_endpoint_serves_no_devices():
    metrics.stop_metrics()
    if gmlake.is_enabled():
        pytest.skip("enabled in this process")
    s = gmlake.serve_metrics(port=0)
    try:
        text, m = scrape(s.url)
        assert not any(name.startswith("gmlake_reserved") for name, _ in m)
    finally:
        metrics.stop_metrics()


def test_a_missing_prometheus_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(RuntimeError, match=r"gmlake\[metrics\]"):
        gmlake.serve_metrics(port=0)
