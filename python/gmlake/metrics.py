"""A Prometheus endpoint for gmlake's allocator statistics.

    gmlake.serve_metrics(port=9400)              # in the program, after gmlake.enable()
    python -m gmlake --metrics-port 9400 train.py

Serves ``http://ADDR:PORT/metrics`` from a daemon thread (prometheus-client's server; needs
``pip install 'gmlake[metrics]'``). Each scrape reads each device's statistics once
(:func:`gmlake.raw_stats`: one copy of the allocator's counters, taken under its lock for a
few microseconds; the formatting and the HTTP work happen outside it), so scraping never
holds up allocations. Devices the allocator has not used yet report zeros.

Metrics, each labelled ``device`` (the CUDA ordinal); ``driver_calls`` also ``kind``:

=========================================  ==================================================
``gmlake_reserved_bytes``                  memory mapped from the GPU (PyTorch's reserved)
``gmlake_reserved_peak_bytes``             its peak
``gmlake_active_bytes``                    in blocks handed out (PyTorch's active)
``gmlake_active_peak_bytes``               its peak
``gmlake_allocated_bytes``                 PyTorch's allocated
``gmlake_requested_bytes``                 what the program asked for
``gmlake_cached_bytes``                    free and mapped (reusable without the driver)
``gmlake_largest_free_block_bytes``        the largest free mapped block
``gmlake_fragmentation_ratio``             1 - active / reserved (0 when nothing is reserved)
``gmlake_free_fragmentation_ratio``        1 - largest free block / cached (0 when no cache):
                                           how scattered the free memory is
``gmlake_device_total_bytes``              the device's memory
``gmlake_initialized``                     1 once the device has had an allocation
``gmlake_stitches_total``                  stitched ranges made
``gmlake_pages_stitched_total``            pages mapped into them
``gmlake_stitch_reuses_total``             stitched ranges reused (kept mappings)
``gmlake_driver_calls_total``              CUDA driver calls, by ``kind`` (map, unmap, ...)
``gmlake_driver_seconds_total``            host time those calls took (every call timed)
``gmlake_ooms_total``                      out-of-memory errors raised
``gmlake_alloc_retries_total``             allocations retried after freeing the cache
``gmlake_debug_canary_errors_total``       damaged canaries found (memory debugging mode)
=========================================  ==================================================
"""

from __future__ import annotations

import errno
import threading
from typing import Any, Callable, Dict, Iterable, Optional

__all__ = ["GmlakeCollector", "serve_metrics", "stop_metrics", "MetricsServer"]

StatsFn = Callable[[int], Dict[str, Any]]
DevicesFn = Callable[[], Iterable[int]]

_GAUGES = [
    # name, help, stats key
    ("reserved_bytes", "Memory mapped from the GPU (PyTorch's reserved bytes).", "reserved_bytes.all.current"),
    ("reserved_peak_bytes", "Peak of reserved bytes.", "reserved_bytes.all.peak"),
    ("active_bytes", "Bytes in blocks handed out (PyTorch's active bytes).", "active_bytes.all.current"),
    ("active_peak_bytes", "Peak of active bytes.", "active_bytes.all.peak"),
    ("allocated_bytes", "PyTorch's allocated bytes.", "allocated_bytes.all.current"),
    ("requested_bytes", "Bytes the program requested.", "requested_bytes.all.current"),
    ("cached_bytes", "Free mapped bytes, reusable without driver calls.", "gmlake.cached_bytes"),
    ("largest_free_block_bytes", "The largest free mapped block.", "gmlake.largest_free_block"),
    ("device_total_bytes", "The device's total memory.", "gmlake.device_total"),
    ("initialized", "1 once the allocator has served the device.", "gmlake.initialized"),
]
_COUNTERS = [
    ("stitches", "Stitched ranges made.", "gmlake.stitches"),
    ("pages_stitched", "Pages mapped into stitched ranges.", "gmlake.pages_stitched"),
    ("stitch_reuses", "Stitched ranges reused from kept mappings.", "gmlake.stitch_reuses"),
    ("driver_seconds", "Host time the allocator's CUDA driver calls took.", "gmlake.driver_ns", 1e-9),
    ("ooms", "Out-of-memory errors raised.", "num_ooms"),
    ("alloc_retries", "Allocations retried after releasing cached memory.", "num_alloc_retries"),
    ("debug_canary_errors", "Damaged canaries found (memory debugging mode; 0 when off).", "gmlake.debug_canary_errors"),
]
_DRIVER_PREFIX = "gmlake.driver_calls."


def _num(s: Dict[str, Any], key: str) -> float:
    v = s.get(key, 0)
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _default_devices() -> Iterable[int]:
    import gmlake

    return range(gmlake.device_count())


def _default_stats(device: int) -> Dict[str, Any]:
    import gmlake

    return gmlake.raw_stats(device)


class GmlakeCollector:
    """A prometheus-client collector: on each collect, one ``stats_fn(device)`` per device of
    ``devices_fn()`` (defaults: :func:`gmlake.raw_stats` over the allocator's devices)."""

    def __init__(self, stats_fn: Optional[StatsFn] = None, devices_fn: Optional[DevicesFn] = None):
        self.stats_fn = stats_fn or _default_stats
        self.devices_fn = devices_fn or _default_devices

    def describe(self):
        return []  # no scrape at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gauges = {n: GaugeMetricFamily(f"gmlake_{n}", h, labels=["device"]) for n, h, _ in _GAUGES}
        frag = GaugeMetricFamily(
            "gmlake_fragmentation_ratio",
            "1 - active/reserved: the share of reserved memory not in use.", labels=["device"])
        free_frag = GaugeMetricFamily(
            "gmlake_free_fragmentation_ratio",
            "1 - largest free block/cached bytes: how scattered the free memory is.", labels=["device"])
        counters = {c[0]: CounterMetricFamily(f"gmlake_{c[0]}", c[1], labels=["device"]) for c in _COUNTERS}
        driver = CounterMetricFamily(
            "gmlake_driver_calls", "CUDA driver calls made by the allocator, by kind.",
            labels=["device", "kind"])
        errors = GaugeMetricFamily(
            "gmlake_stats_error", "1 if the device's statistics could not be read in this scrape.",
            labels=["device"])
        for dev in self.devices_fn():
            d = str(dev)
            try:
                s = self.stats_fn(dev)
            except Exception:  # a device that cannot be read now: say so, keep the others
                errors.add_metric([d], 1)
                continue
            errors.add_metric([d], 0)
            for n, _, key in _GAUGES:
                gauges[n].add_metric([d], _num(s, key))
            reserved = _num(s, "reserved_bytes.all.current")
            active = _num(s, "active_bytes.all.current")
            cached = _num(s, "gmlake.cached_bytes")
            largest = _num(s, "gmlake.largest_free_block")
            frag.add_metric([d], max(0.0, 1.0 - active / reserved) if reserved > 0 else 0.0)
            free_frag.add_metric([d], max(0.0, 1.0 - largest / cached) if cached > 0 else 0.0)
            for n, _, key, *scale in _COUNTERS:
                counters[n].add_metric([d], _num(s, key) * (scale[0] if scale else 1))
            for k, v in s.items():
                if k.startswith(_DRIVER_PREFIX):
                    driver.add_metric([d, k[len(_DRIVER_PREFIX):]], _num(s, k))
        yield from gauges.values()
        yield frag
        yield free_frag
        yield from counters.values()
        yield driver
        yield errors


class MetricsServer:
    """A running endpoint: ``url``, ``port``, ``addr``; :meth:`shutdown` stops it."""

    def __init__(self, httpd, thread, addr: str, port: int, registry):
        self._httpd = httpd
        self._thread = thread
        self.addr = addr
        self.port = port
        self.registry = registry

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def shutdown(self) -> None:
        global _server
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        with _server_lock:
            if _server is self:
                _server = None

    def __repr__(self) -> str:
        return f"MetricsServer({self.url})"


_server: Optional[MetricsServer] = None
_server_lock = threading.Lock()


def _check_port(port: Any) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        try:
            port = int(str(port), 10)
        except ValueError:
            raise ValueError(f"gmlake: invalid metrics port {port!r}: give a number from 1 to 65535") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"gmlake: invalid metrics port {port}: out of range (1-65535; 0 picks a free port)")
    return port


def serve_metrics(
    port: int = 9400,
    addr: str = "127.0.0.1",
    *,
    stats_fn: Optional[StatsFn] = None,
    devices_fn: Optional[DevicesFn] = None,
) -> MetricsServer:
    """Starts the Prometheus endpoint ``http://ADDR:PORT/metrics`` in a daemon thread and
    returns it (port 0: a free port, see ``.port``). One per process: a second call raises
    ``RuntimeError`` naming the running one. Raises ``ValueError`` for a port out of range,
    ``RuntimeError`` when the port is in use or the address cannot be bound, and when
    prometheus-client is missing. ``stats_fn`` / ``devices_fn`` replace the statistics source
    (tests)."""
    global _server
    port = _check_port(port)
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise RuntimeError(
            "gmlake: the metrics endpoint needs prometheus-client: pip install 'gmlake[metrics]' "
            f"(or pip install prometheus-client) ({e})"
        ) from None
    with _server_lock:
        if _server is not None:
            raise RuntimeError(
                f"gmlake: a metrics server already runs in this process at {_server.url} "
                "(one per process; stop it with gmlake.metrics.stop_metrics())"
            )
        registry = CollectorRegistry(auto_describe=False)
        registry.register(GmlakeCollector(stats_fn, devices_fn))
        try:
            started = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(
                    f"gmlake: cannot serve metrics on {addr}:{port}: the port is in use "
                    "(another process or server); pick another with --metrics-port / port="
                ) from None
            raise RuntimeError(f"gmlake: cannot serve metrics on {addr}:{port}: {e}") from None
        if not started:  # prometheus-client < 0.17 returns nothing
            raise RuntimeError("gmlake: prometheus-client >= 0.17 is needed (pip install -U prometheus-client)")
        httpd, thread = started
        _server = MetricsServer(httpd, thread, addr, httpd.server_port, registry)
        return _server


def stop_metrics() -> None:
    """Stops the process's metrics server, if one runs."""
    s = _server
    if s is not None:
        s.shutdown()
