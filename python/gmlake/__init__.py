"""gmlake: the GMLake GPU memory allocator (virtual memory stitching) for PyTorch.

Installs gmlake as PyTorch's CUDA caching allocator at run time, from ``libgmlake_torch.so``
(built against the same torch minor version; see docs/pytorch.md)::

    import torch
    import gmlake
    gmlake.enable(fragLimit="16MiB", stitch_strategy="best_fit")  # before CUDA is used
    ...
    gmlake.stats()["gmlake.stitches"]

Or without changing the program: ``python -m gmlake train.py args...``.

Configuration: GMLake's environment variables (``vmmDefragment``, ``fragLimit``,
``reuseLimit``, ``defragLevel``, ``autoGC``) and ``GMLAKE_CONF`` (``key:value,...``), then the
keywords given to :func:`enable`. Invalid values raise ``RuntimeError`` naming the key and the
value.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = [
    "enable",
    "is_enabled",
    "stats",
    "snapshot",
    "settings",
    "library_path",
    "build_info",
    "check_config",
    "conf_string",
    "check_torch",
    "serve_metrics",
    "raw_stats",
    "device_count",
    "debug_report",
    "debug_check",
    "tier",
]

_BASE_VERSION = "0.1.0"
try:  # written when a wheel is built (python/_build/gmlake_backend.py)
    from . import _build_info  # type: ignore[attr-defined]

    __version__: str = _build_info.__version__
except ImportError:  # a source checkout used through PYTHONPATH=python
    _build_info = None  # type: ignore[assignment]
    __version__ = _BASE_VERSION

_LIB_NAME = "libgmlake_torch.so"
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def _candidates():
    env = os.environ.get("GMLAKE_LIBRARY")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield here / _LIB_NAME
    # A source checkout used through PYTHONPATH=python: the repository's build folders.
    repo = here.parent.parent
    for sub in ("build/torch-ext", "build/torch", ".artifacts/gpu"):
        yield repo / sub / _LIB_NAME


def library_path() -> str:
    """The path of the libgmlake_torch.so that :func:`enable` loads (or has loaded).

    Looked for in ``$GMLAKE_LIBRARY`` (only there when set), next to this package, then in a
    source checkout's ``build/torch-ext``, ``build/torch`` and ``.artifacts/gpu``. Raises
    ``RuntimeError`` if none exists.
    """
    if _lib_path is not None:
        return _lib_path
    tried = []
    for c in _candidates():
        tried.append(str(c))
        if c.is_file():
            return str(c)
    raise RuntimeError(
        "gmlake: libgmlake_torch.so not found (tried: "
        + ", ".join(tried)
        + "). Install the package with its library (pip install <gmlake checkout>/python "
        "--no-build-isolation), build it with scripts/build-torch-ext.sh or cmake "
        "(docs/pytorch.md), or set GMLAKE_LIBRARY to its path."
    )


def _packaged_library() -> Path:
    return Path(__file__).resolve().parent / _LIB_NAME


def check_torch(torch_version: str, cuda_version: Optional[str]) -> None:
    """Raises ``RuntimeError`` naming both versions if the library installed with this package
    was built for another torch (major.minor) or CUDA major version than the given ones.
    Does nothing in a source checkout (no ``_build_info``); there the library checks itself."""
    if _build_info is None:
        return

    def major_minor(v: str):
        parts = str(v).split("+")[0].split(".")
        try:
            return int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            return None

    built = tuple(_build_info.TORCH_MAJOR_MINOR)
    built_cuda = _build_info.CUDA_VERSION
    what = (
        f"gmlake {__version__} was built for torch {built[0]}.{built[1]} with CUDA {built_cuda} "
        f"(torch {_build_info.TORCH_VERSION})"
    )
    fix = (
        "; reinstall gmlake against this torch (pip install <gmlake checkout>/python "
        "--no-build-isolation) or use a torch that matches"
    )
    if major_minor(torch_version) != built:
        raise RuntimeError(f"gmlake: {what}, but this process runs torch {torch_version}{fix}")
    if not cuda_version:
        raise RuntimeError(f"gmlake: {what}, but this process runs torch {torch_version}, built without CUDA{fix}")
    if str(cuda_version).split(".")[0] != str(built_cuda).split(".")[0]:
        raise RuntimeError(
            f"gmlake: {what}, but this process runs torch {torch_version} with CUDA {cuda_version}{fix}"
        )


def _load() -> ctypes.CDLL:
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        # torch first: its libraries (libc10, libc10_cuda, libcudart) satisfy ours by soname.
        try:
            import torch
        except ImportError as e:
            raise RuntimeError(f"gmlake: torch cannot be imported ({e}): gmlake runs inside PyTorch") from e

        if _build_info is not None and Path(path).resolve() == _packaged_library():
            check_torch(torch.__version__, getattr(getattr(torch, "version", None), "cuda", None))

        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise RuntimeError(f"gmlake: cannot load {path}: {e}") from e
        lib.gmlake_install.argtypes = [ctypes.c_char_p]
        lib.gmlake_install.restype = ctypes.c_int
        lib.gmlake_install_checked.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
        lib.gmlake_install_checked.restype = ctypes.c_int
        lib.gmlake_is_installed.argtypes = []
        lib.gmlake_is_installed.restype = ctypes.c_int
        lib.gmlake_last_error.argtypes = []
        lib.gmlake_last_error.restype = ctypes.c_char_p
        lib.gmlake_build_info.argtypes = []
        lib.gmlake_build_info.restype = ctypes.c_char_p
        lib.gmlake_check_conf.argtypes = [ctypes.c_char_p]
        lib.gmlake_check_conf.restype = ctypes.c_int
        lib.gmlake_device_count.argtypes = []
        lib.gmlake_device_count.restype = ctypes.c_int
        for name in ("gmlake_stats_json", "gmlake_snapshot_json"):
            f = getattr(lib, name)
            f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
            f.restype = ctypes.c_longlong
        lib.gmlake_settings.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.gmlake_settings.restype = ctypes.c_longlong
        if hasattr(lib, "gmlake_debug_check"):
            lib.gmlake_debug_check.argtypes = [ctypes.c_int]
            lib.gmlake_debug_check.restype = ctypes.c_longlong
            lib.gmlake_debug_reports_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
            lib.gmlake_debug_reports_json.restype = ctypes.c_longlong
        _lib, _lib_path = lib, path
        return lib


def _last_error(lib: ctypes.CDLL) -> str:
    msg = lib.gmlake_last_error()
    return msg.decode("utf-8", "replace") if msg else "gmlake: unknown error"


def _format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and v == float("inf"):
        return "inf"
    return str(v)


def conf_string(conf: Optional[str] = None, **config: Any) -> str:
    """``key:value,...`` from a conf string and keywords (keywords last, so they win;
    ``None`` values are left out; booleans become 1/0)."""
    parts = []
    if conf:
        parts.append(conf.strip().strip(","))
    for k, v in config.items():
        if v is None:
            continue
        s = _format_value(v)
        # A list value in PyTorch's syntax ([64:8,256:4,>:1]) keeps its commas in brackets.
        listed = s.startswith("[") and s.endswith("]") and s.count("[") == 1 and s.count("]") == 1
        if ("," in s and not listed) or ":" in k or "," in k:
            raise ValueError(f"gmlake: invalid configuration item {k}={s!r}")
        parts.append(f"{k}:{s}")
    return ",".join(p for p in parts if p)


def check_config(conf: Optional[str] = None, **config: Any) -> None:
    """Checks a configuration (environment, then ``conf`` and keywords) without installing;
    raises ``RuntimeError`` naming the offending key and value."""
    lib = _load()
    if lib.gmlake_check_conf(conf_string(conf, **config).encode()) != 0:
        raise RuntimeError(_last_error(lib))


def enable(conf: Optional[str] = None, **config: Any) -> None:
    """Installs gmlake as PyTorch's CUDA allocator.

    Must run before anything initializes CUDA in this process (right after ``import torch``).
    ``conf`` is a ``key:value,...`` string; keywords are added to it (e.g.
    ``enable(fragLimit="16MiB", defragLevel=0, vmmDefragment=True)``). Both override the
    environment (GMLake's variables and ``GMLAKE_CONF``). Calling it again with the same
    configuration does nothing.

    Raises ``RuntimeError`` with the library's message if CUDA is already initialized, if the
    library was built for another torch version or C++ ABI, or if a value is invalid.
    """
    text = conf_string(conf, **config)
    lib = _load()
    import torch

    flag = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    abi = -1 if flag is None else int(bool(flag))
    rc = lib.gmlake_install_checked(text.encode(), torch.__version__.encode(), abi)
    if rc != 0:
        raise RuntimeError(_last_error(lib))
    _debug_setup()


# History actions left out while the debug mode records stacks for its reports only.
_DEBUG_SKIP = [
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
]


def _debug_modes() -> List[str]:
    """The memory debugging modes on (``debug:`` of the settings), e.g. ``["guard", "canary"]``."""
    for item in settings().split(","):
        k, _, v = item.partition(":")
        if k == "debug":
            return [m for m in v.split("+") if m and m != "off"]
    return []


def _debug_setup() -> None:
    """Debug mode with canaries: record the Python stack of each allocation (through torch's
    memory history, actions skipped so that it keeps only gmlake's reports), so that a report
    names the allocation's frames. Deferred to CUDA's initialization (recording history
    initializes CUDA). ``GMLAKE_DEBUG_STACKS=0`` turns it off."""
    try:
        if "canary" not in _debug_modes() or os.environ.get("GMLAKE_DEBUG_STACKS", "1") == "0":
            return
        import torch.cuda

        torch.cuda._lazy_call(_debug_record_stacks)
    except Exception as e:  # the reports lose their frames, nothing else
        import warnings

        warnings.warn(f"gmlake: debug mode cannot record allocation stacks: {e}")


def _debug_record_stacks() -> None:
    try:
        import torch

        rec = torch.cuda.memory._record_memory_history
        try:
            rec(
                enabled="all",
                context="alloc",
                stacks="python",
                max_entries=10000,
                skip_actions=_DEBUG_SKIP,
            )
        except Exception:  # torch without skip_actions (or other names): the whole history
            rec(enabled="all", context="alloc", stacks="python", max_entries=100000)
    except Exception as e:  # the reports lose their frames, nothing else
        import warnings

        warnings.warn(f"gmlake: debug mode cannot record allocation stacks: {e}")


def debug_check(wait: bool = True) -> int:
    """Memory debugging mode: checks the canaries of the blocks freed so far (with ``wait``,
    after waiting for their stream-ordered copies; otherwise only those already done) and
    returns the number of reports so far. Raises ``RuntimeError`` if gmlake is not enabled."""
    if not is_enabled():
        raise RuntimeError("gmlake is not enabled in this process (call gmlake.enable() first)")
    n = _lib.gmlake_debug_check(1 if wait else 0)
    if n < 0:
        raise RuntimeError(_last_error(_lib))
    return int(n)


def debug_report(wait: bool = True) -> List[Dict[str, Any]]:
    """Memory debugging mode (``GMLAKE_CONF=debug:...``, see docs/pytorch.md "Memory
    debugging"): the damaged canaries found so far, after :func:`debug_check`, as dicts:
    ``kind`` ("canary"), ``device``, ``address``, ``requested`` (bytes asked for), ``size``
    (the block's bytes), ``stream``, ``first_bad`` (offset past the end of the request of the
    first damaged byte), ``bad_bytes``, ``canary_bytes``, ``message``, and ``frames``: the
    Python stack of the allocation (file, line, function dicts, innermost first; empty when no
    stack was recorded)."""
    debug_check(wait)
    reports = json.loads(_json_call(_lib.gmlake_debug_reports_json))
    if not reports:
        return reports
    traces: List[Any] = []
    try:
        import torch

        traces = torch.cuda.memory._snapshot().get("device_traces", [])
    except Exception:
        pass
    for r in reports:
        r["frames"] = []
        dev = r["device"]
        if 0 <= dev < len(traces):
            for t in reversed(traces[dev]):
                if (
                    t.get("action") == "snapshot"
                    and t.get("addr") == r["address"]
                    and t.get("size") == r["requested"]
                ):
                    r["frames"] = list(t.get("frames", []))
                    break
    return reports


def is_enabled() -> bool:
    """Whether gmlake is PyTorch's current CUDA allocator in this process."""
    if _lib is None:
        return False
    return bool(_lib.gmlake_is_installed())


def _json_call(fn, *args) -> Any:
    n = fn(*args, None, 0)
    if n < 0:
        raise RuntimeError(_last_error(_lib))
    buf = ctypes.create_string_buffer(n + 1)
    n2 = fn(*args, buf, n + 1)
    if n2 < 0:
        raise RuntimeError(_last_error(_lib))
    if n2 > n:  # grew in between: once more
        buf = ctypes.create_string_buffer(n2 + 1)
        if fn(*args, buf, n2 + 1) < 0:
            raise RuntimeError(_last_error(_lib))
    return buf.value.decode("utf-8")


def _device_index(device) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def stats(device=None) -> Dict[str, Any]:
    """``torch.cuda.memory_stats(device)`` plus gmlake's own counters under ``gmlake.``:
    ``gmlake.stitches``, ``gmlake.pages_stitched``, ``gmlake.cached_bytes``,
    ``gmlake.retired_bytes``, ``gmlake.pending_frees``, ``gmlake.unknown_frees``,
    ``gmlake.ipc_shares``, ``gmlake.ipc_imports``, ``gmlake.ipc_imported_bytes``,
    the memory debugging mode's ``gmlake.debug_guarded``, ``gmlake.debug_guard_bytes``,
    ``gmlake.debug_quarantine_blocks``, ``gmlake.debug_quarantine_bytes``,
    ``gmlake.debug_canary_errors``, ``gmlake.debug_pages`` (0 when it is off),
    ``gmlake.initialized`` (0 until the device's first allocation, all counters then zero),
    ``gmlake.driver_calls`` (total) and ``gmlake.driver_calls.<kind>`` (``stream_wait``: the
    device-side waits of ``cross_stream_wait``), ``gmlake.driver_ns`` (the host time those
    calls took, every call timed), ``gmlake.driver_share_notices`` (1 once the allocator has
    said that driver calls take a large share of the job's time: ``driver_share_notice``),
    ``gmlake.driver_share_upgrades`` (page-size upgrades made for that:
    ``driver_share_upgrade``), ``gmlake.stream_waits_failed`` (waits the
    device refused), ``gmlake.pages_created_unfenced`` (pages created while another stream's
    freed pages were still in use by its queued work), ``gmlake.reuses_unfenced`` (kept
    windows not taken because the stream had not yet finished the work queued before their
    addresses were freed), ``gmlake.reuses_awaited`` (such windows taken after waiting for
    that work, 20 queries 50 µs apart), ``gmlake.reuses_after_wait`` (``wait_to_reuse``: kept
    windows taken back behind a device-side wait for the streams holding their pages),
    ``gmlake.reuses_fenced_blocks`` (``reuse_fenced_blocks``: kept windows found by the scan
    made again after bringing the other streams' fences up to date),
    ``gmlake.alias_evictions``,
    ``gmlake.device_total``, ``gmlake.page_size`` (the page new memory gets: after a
    page-size upgrade, the larger one), ``gmlake.page_upgrades`` and ``gmlake.pages_drained``
    (``page_upgrade_at``: the upgrade done, and the smaller pages given back since),
    ``gmlake.retired_waits`` (creations of pages that first waited for pages given back to
    be released, so that the two are not held at once),
    ``gmlake.largest_free_block``, and with
    ``host_timing`` on, the time spent in allocations and frees and the calls timed:
    ``gmlake.host_ns_alloc``, ``gmlake.host_calls_alloc``, ``gmlake.host_ns_free``,
    ``gmlake.host_calls_free``. (No device free memory: reading it can
    wait for the GPU; use ``torch.cuda.mem_get_info()``.)
    Raises ``RuntimeError`` if gmlake is not installed."""
    if not is_enabled():
        raise RuntimeError("gmlake is not enabled in this process (call gmlake.enable() first)")
    import torch

    idx = _device_index(device)
    out: Dict[str, Any] = dict(torch.cuda.memory_stats(idx))
    own = json.loads(_json_call(_lib.gmlake_stats_json, idx))
    for k, v in own.items():
        if k.startswith("gmlake."):
            out[k] = v
    return out


def raw_stats(device: int) -> Dict[str, Any]:
    """gmlake's statistics of one device from one read of the allocator (no call into torch):
    PyTorch's keys (``reserved_bytes.all.current``, ``num_ooms``, ...) and gmlake's
    (``gmlake.*``, including ``gmlake.largest_free_block``). ``gmlake.initialized`` is 0 (all
    zero) until the device's first allocation. What the metrics endpoint reads."""
    if not is_enabled():
        raise RuntimeError("gmlake is not enabled in this process (call gmlake.enable() first)")
    return json.loads(_json_call(_lib.gmlake_stats_json, int(device)))


def device_count() -> int:
    """The number of devices the installed allocator knows (0 before CUDA initializes)."""
    if not is_enabled():
        return 0
    return int(_lib.gmlake_device_count())


def serve_metrics(port: int = 9400, addr: str = "127.0.0.1", **kwargs: Any):
    """Starts a Prometheus endpoint (http://ADDR:PORT/metrics) with gmlake's per-device
    statistics, in a background thread; see :mod:`gmlake.metrics`. Needs prometheus-client
    (``pip install 'gmlake[metrics]'``). Returns the server."""
    from .metrics import serve_metrics as _serve

    return _serve(port=port, addr=addr, **kwargs)


def snapshot(device=None) -> Dict[str, Any]:
    """gmlake's view of a device's memory: segments (runs of mapped pages) with their blocks,
    ``stitched`` flags, page counts, the page size and the configuration; with
    ``host_timing:1``, ``slow_calls``: the last 65,536 allocations and frees that took 50 µs
    or more (``start_unix_ns``, ``ns``, ``op``, ``size``), to place on a profiler's timeline
    (bench/workloads/common.py does for ``--profile-step``), with where their time went
    (``lock_wait_ns`` waiting for the allocator's lock, ``driver_ns`` in ``driver_calls``
    driver calls, the slowest of them ``slowest_driver`` and ``slowest_driver_ns``; the rest
    is the allocator's own work). (PyTorch's own
    ``torch.cuda.memory._snapshot()`` works too and includes history.)"""
    if not is_enabled():
        raise RuntimeError("gmlake is not enabled in this process (call gmlake.enable() first)")
    return json.loads(_json_call(_lib.gmlake_snapshot_json, _device_index(device)))


def settings() -> str:
    """The effective configuration, ``backend:gmlake,key:value,...``."""
    if not is_enabled():
        raise RuntimeError("gmlake is not enabled in this process (call gmlake.enable() first)")
    n = _lib.gmlake_settings(None, 0)
    if n < 0:
        raise RuntimeError(_last_error(_lib))
    buf = ctypes.create_string_buffer(n + 1)
    _lib.gmlake_settings(buf, n + 1)
    return buf.value.decode("utf-8")


def build_info() -> Dict[str, Any]:
    """What the loaded library was built against: torch version, C++ ABI, CUDA runtime."""
    return json.loads(_load().gmlake_build_info().decode())


# The host tier (gmlake.tier.put / get / free, offload_activations): imports no torch at load.
from . import tier  # noqa: E402
