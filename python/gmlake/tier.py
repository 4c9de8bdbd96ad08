"""gmlake.tier: a host tier under gmlake (issue 16, after the memory-harvesting report).

Tensors handed to the tier may be evicted to pinned host memory under memory pressure and
brought back (possibly at another address) when asked for::

    import gmlake, gmlake.tier
    gmlake.enable()
    gmlake.tier.configure(budget_bytes=2 << 30, policy="aware")
    h = gmlake.tier.put(activation, next_use=3)  # the tier owns its memory from now on
    del activation                                # now evictable
    ...
    activation = gmlake.tier.get(h)               # resident again, on the current stream
    gmlake.tier.free(h)

or for the activations saved for backward::

    with gmlake.tier.offload_activations():
        loss = model(x).sum()
    loss.backward()

Rules:

- ``put`` takes a CUDA tensor whose memory gmlake allocated (else ``RuntimeError`` saying
  so). Every tensor on that storage stays valid: while any of them lives, the tier keeps the
  memory on the device; when the last goes, the tier may evict it (it is *put*).
- ``get`` returns a tensor of the same dtype, shape, strides and storage offset, safe to use on
  the current stream (copies are queued there). While it (or any tensor got from the handle)
  lives, the memory stays on the device; afterwards the handle is put again.
- ``free`` drops the handle; the memory goes once no tensor of it lives either.
- ``next_use``: a logical time (an integer >= 0, in the units of :func:`advance`) at which the
  tensor is needed again: the size/latency-aware policy evicts what is needed last first and
  ``advance`` prefetches what is needed soon.
- Under a budget (``configure(budget_bytes=...)``) put tensors are evicted so that the device
  bytes the tier holds (minus evictions in flight) stay within it; without one, they are
  evicted when an allocation of gmlake runs out of memory (before the error is raised).
- Tensors got from the tier ignore ``record_stream``: use them on the stream of ``get`` (or
  synchronize).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from typing import Any, Dict, Optional

__all__ = [
    "configure",
    "put",
    "get",
    "free",
    "state",
    "advance",
    "flush",
    "stats",
    "offload_activations",
]

POLICIES = ("aware", "lru")
_STATES = {0: "resident", 1: "put", 2: "evicting", 3: "evicted", 4: "fetching"}

_lock = threading.Lock()
_ready = False
# handle -> (dtype, size, stride, storage_offset, device)
_meta: Dict[int, Any] = {}


def _setup(lib: ctypes.CDLL) -> None:
    global _ready
    with _lock:
        if _ready:
            return
        c = ctypes
        lib.gmlake_tier_last_error.argtypes = []
        lib.gmlake_tier_last_error.restype = c.c_char_p
        lib.gmlake_tier_configure.argtypes = [
            c.c_int, c.c_int, c.c_uint64, c.c_char_p, c.c_double, c.c_uint64, c.c_int64, c.c_double
        ]
        lib.gmlake_tier_configure.restype = c.c_int
        lib.gmlake_tier_put.argtypes = [c.c_void_p, c.c_uint64, c.c_int64]
        lib.gmlake_tier_put.restype = c.c_int64
        lib.gmlake_tier_get.argtypes = [
            c.c_int64, c.c_uint64, c.POINTER(c.c_uint64), c.POINTER(c.c_uint64), c.POINTER(c.c_int)
        ]
        lib.gmlake_tier_get.restype = c.c_int
        lib.gmlake_tier_bind.argtypes = [c.c_void_p, c.c_int64]
        lib.gmlake_tier_bind.restype = c.c_int
        for name in ("gmlake_tier_unget", "gmlake_tier_free", "gmlake_tier_state"):
            f = getattr(lib, name)
            f.argtypes = [c.c_int64]
            f.restype = c.c_int
        lib.gmlake_tier_advance.argtypes = [c.c_int, c.c_uint64]
        lib.gmlake_tier_advance.restype = c.c_int
        lib.gmlake_tier_flush.argtypes = [c.c_int, c.c_int]
        lib.gmlake_tier_flush.restype = c.c_int
        lib.gmlake_tier_verify.argtypes = [c.c_int]
        lib.gmlake_tier_verify.restype = c.c_int
        lib.gmlake_tier_stats_json.argtypes = [c.c_int, c.c_char_p, c.c_size_t]
        lib.gmlake_tier_stats_json.restype = c.c_longlong
        _ready = True


def _lib() -> ctypes.CDLL:
    import gmlake

    if not gmlake.is_enabled():
        raise RuntimeError("gmlake is not enabled in this process (call gmlake.enable() first)")
    lib = gmlake._load()
    import torch

    torch.cuda.init()  # gmlake's per-device state exists once CUDA is initialized
    if not hasattr(lib, "gmlake_tier_put"):
        raise RuntimeError(
            f"gmlake.tier: {gmlake.library_path()} has no host tier (rebuild libgmlake_torch.so)"
        )
    _setup(lib)
    return lib


def _error(lib: ctypes.CDLL) -> RuntimeError:
    msg = lib.gmlake_tier_last_error()
    return RuntimeError(msg.decode("utf-8", "replace") if msg else "gmlake.tier: unknown error")


def _check_int(name: str, v: Any, allow_none: bool = True) -> Optional[int]:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"gmlake.tier: {name} must be an int, not {type(v).__name__}")
    if v < 0:
        raise ValueError(f"gmlake.tier: {name} must be >= 0, not {v}")
    return v


def _check_float(name: str, v: Any) -> float:
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"gmlake.tier: {name} must be a number, not {type(v).__name__}")
    v = float(v)
    if not (v > 0.0 and v != float("inf")):
        raise ValueError(f"gmlake.tier: {name} must be a finite number > 0, not {v}")
    return v


def check_configure_args(
    budget_bytes: Any = None,
    policy: Any = "aware",
    bandwidth: Any = None,
    host_cache_bytes: Any = 0,
    prefetch_margin: Any = None,
    tick_seconds: Any = None,
) -> Dict[str, Any]:
    """The arguments of :func:`configure`, checked (``TypeError`` / ``ValueError``), as the
    library takes them. Needs neither torch nor the library."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"gmlake.tier: policy must be one of {POLICIES}, not {policy!r}")
    budget = _check_int("budget_bytes", budget_bytes)
    return {
        "has_budget": 0 if budget is None else 1,
        "budget": 0 if budget is None else budget,
        "policy": policy,
        "bandwidth": _check_float("bandwidth", bandwidth),
        "host_cache": _check_int("host_cache_bytes", host_cache_bytes, allow_none=False),
        "prefetch_margin": -1 if prefetch_margin is None else _check_int("prefetch_margin", prefetch_margin),
        "tick_seconds": _check_float("tick_seconds", tick_seconds),
    }


def _device_index(device) -> int:
    import gmlake

    return gmlake._device_index(device)


def configure(
    budget_bytes: Optional[int] = None,
    policy: str = "aware",
    bandwidth: Optional[float] = None,
    host_cache_bytes: int = 0,
    prefetch_margin: Optional[int] = None,
    tick_seconds: Optional[float] = None,
    device=None,
) -> None:
    """Sets the tier of ``device`` (default: the current one).

    ``budget_bytes``: the most device bytes the tier's tensors may hold (None: no budget;
    evictions then happen when gmlake runs out of memory). ``policy``: ``"aware"`` (size- and
    latency-aware cost, docs/design.md "Host tier") or ``"lru"``. ``bandwidth``: host<->device
    bytes per second the aware policy and prefetch assume (None: 25e9). ``host_cache_bytes``:
    pinned buffers kept for reuse. ``prefetch_margin``: ticks of ``advance`` to prefetch early
    (None: 1). ``tick_seconds``: seconds per tick (None: 1e-3)."""
    a = check_configure_args(
        budget_bytes, policy, bandwidth, host_cache_bytes, prefetch_margin, tick_seconds
    )
    lib = _lib()
    rc = lib.gmlake_tier_configure(
        _device_index(device),
        a["has_budget"],
        a["budget"],
        a["policy"].encode(),
        a["bandwidth"],
        a["host_cache"],
        a["prefetch_margin"],
        a["tick_seconds"],
    )
    if rc != 0:
        raise _error(lib)


def _current_stream(device) -> int:
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream)


def put(tensor, next_use: Optional[int] = None) -> int:
    """Hands ``tensor``'s memory to the tier; returns a handle (an int) for :func:`get` and
    :func:`free`. See the module documentation."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"gmlake.tier.put: expected a torch.Tensor, not {type(tensor).__name__}")
    nu = _check_int("next_use", next_use)
    if not tensor.is_cuda:
        raise ValueError(f"gmlake.tier.put: the tensor is on {tensor.device}, not a CUDA device")
    if tensor.untyped_storage().nbytes() == 0:
        raise ValueError("gmlake.tier.put: the tensor has no memory (empty storage)")
    lib = _lib()
    st = tensor.untyped_storage()
    h = lib.gmlake_tier_put(st._cdata, _current_stream(tensor.device), -1 if nu is None else nu)
    if h < 0:
        raise _error(lib)
    _meta[h] = (
        tensor.dtype,
        tuple(tensor.size()),
        tuple(tensor.stride()),
        tensor.storage_offset(),
        tensor.device,
    )
    return int(h)


def _handle(handle: Any) -> int:
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"gmlake.tier: a handle is an int, not {type(handle).__name__}")
    if handle not in _meta:
        raise ValueError(f"gmlake.tier: unknown handle {handle} (freed already?)")
    return handle


def get(handle: int):
    """The tensor of ``handle``, resident on the device, safe on the current stream."""
    h = _handle(handle)
    import torch

    dtype, size, stride, offset, device = _meta[h]
    lib = _lib()
    ptr, nbytes, dev = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
    if lib.gmlake_tier_get(h, _current_stream(device), ctypes.byref(ptr), ctypes.byref(nbytes), ctypes.byref(dev)) != 0:
        raise _error(lib)
    try:
        st = torch._C._construct_storage_from_data_pointer(ptr.value, device, nbytes.value)
        if lib.gmlake_tier_bind(st._cdata, h) != 0:
            raise _error(lib)
    except BaseException:
        lib.gmlake_tier_unget(h)
        raise
    t = torch.empty((0,), dtype=dtype, device=device)
    t.set_(st, offset, size, stride)
    return t


def free(handle: int) -> None:
    """Drops ``handle``; the memory goes once no tensor got from it lives either."""
    h = _handle(handle)
    lib = _lib()
    if lib.gmlake_tier_free(h) != 0:
        raise _error(lib)
    _meta.pop(h, None)


def state(handle: int) -> str:
    """Where the tensor of ``handle`` is: resident, put, evicting, evicted or fetching."""
    h = _handle(handle)
    lib = _lib()
    s = lib.gmlake_tier_state(h)
    if s < 0:
        raise _error(lib)
    return _STATES.get(s, str(s))


def advance(now: int, device=None) -> None:
    """Moves the tier's clock to ``now`` (never backwards): evicted tensors whose ``next_use``
    is within reach are copied back ahead of their use."""
    n = _check_int("now", now, allow_none=False)
    lib = _lib()
    if lib.gmlake_tier_advance(_device_index(device), n) != 0:
        raise _error(lib)


def flush(device=None, trim: bool = False) -> None:
    """Waits for the device and completes every copy; ``trim``: also frees the pinned buffers
    kept for reuse."""
    lib = _lib()
    if lib.gmlake_tier_flush(_device_index(device), 1 if trim else 0) != 0:
        raise _error(lib)


def verify(device=None) -> None:
    """Checks the tier's invariants (tests); raises ``RuntimeError`` naming a broken one."""
    lib = _lib()
    if lib.gmlake_tier_verify(_device_index(device)) != 0:
        raise _error(lib)


def stats(device=None) -> Dict[str, Any]:
    """The tier's counters: puts, gets (hits, misses), evictions, prefetches, bytes_to_host,
    bytes_to_device, device_bytes / peak_device_bytes, host_bytes / peak_host_bytes, waits,
    adopts, tensors, handles, and the settings (budget, policy, bandwidth)."""
    lib = _lib()
    idx = _device_index(device)
    n = lib.gmlake_tier_stats_json(idx, None, 0)
    if n < 0:
        raise _error(lib)
    buf = ctypes.create_string_buffer(n + 64)
    if lib.gmlake_tier_stats_json(idx, buf, n + 64) < 0:
        raise _error(lib)
    return json.loads(buf.value.decode())


class _Packed:
    """A saved activation in the tier (its handle is freed with it)."""

    __slots__ = ("handle", "tick", "device", "__weakref__")

    def __init__(self, handle: int, tick: int, device) -> None:
        self.handle = handle
        self.tick = tick
        self.device = device

    def __del__(self) -> None:
        try:
            if self.handle in _meta:
                free(self.handle)
        except Exception:
            pass


# Logical time: each offload_activations context takes a window of _SPAN ticks after the
# tier's clock; the k-th tensor saved in it is needed at base + _SPAN - k (backward runs in
# reverse), so the clock only moves forward across iterations.
_SPAN = 1 << 24
_epoch_lock = threading.Lock()
_next_base: Dict[int, int] = {}


@contextlib.contextmanager
def offload_activations(min_bytes: int = 1 << 20, prefetch: bool = True):
    """Puts the activations saved for backward inside the block into the tier.

    CUDA tensors of at least ``min_bytes`` allocated by gmlake (not parameters) are handed to
    the tier with ``next_use`` from the forward order (the last saved is needed first); in
    backward each is got back, and with ``prefetch`` the clock advances so that the ones needed
    next are copied back ahead of time. Other tensors are saved as usual."""
    import torch

    mb = _check_int("min_bytes", min_bytes, allow_none=False)
    counter = [0]
    bases: Dict[int, int] = {}

    def base_for(device) -> int:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        b = bases.get(idx)
        if b is None:
            with _epoch_lock:
                now = int(stats(idx).get("now", 0))
                b = max(now + 1, _next_base.get(idx, 0))
                _next_base[idx] = b + _SPAN + 1
            bases[idx] = b
        return b

    def pack(t):
        # Parameters and their views (addmm saves weight.t()) stay: they live on anyway.
        base = t._base if t._base is not None else t
        if (
            not t.is_cuda
            or isinstance(base, torch.nn.Parameter)
            or (base.is_leaf and base.requires_grad)
            or t.untyped_storage().nbytes() < mb
        ):
            return t
        counter[0] += 1
        tick = base_for(t.device) + _SPAN - counter[0]
        try:
            h = put(t, next_use=tick)
        except RuntimeError:
            return t  # not gmlake's memory (or no room to track it): saved as usual
        return _Packed(h, tick, t.device)

    def unpack(p):
        if not isinstance(p, _Packed):
            return p
        if prefetch:
            advance(p.tick, p.device)
        return get(p.handle)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
