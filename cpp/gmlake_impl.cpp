// gmlake::Impl: see gmlake_impl.h.
#include "gmlake_impl.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <unordered_set>

#include "version_compat.h"

#if GMLAKE_TORCH_VERSION_NUM >= 211
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif

namespace gmlake {

namespace {

// PyTorch's allocator settings (PYTORCH_CUDA_ALLOC_CONF, or
// torch.cuda.memory._set_allocator_settings at run time) as torch parsed and checked them:
// torch parses every key, gmlake reads those that mean something for it.
size_t torch_roundup_divisions(size_t size) {
#if GMLAKE_TORCH_VERSION_NUM >= 211
  return c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
#else
  (void)size;
  return 0;
#endif
}

// per_process_memory_fraction (1.0 when unset). Reading it makes torch parse the settings,
// so an invalid value raises torch's own error (ValueError in Python), as under PyTorch's
// allocator when CUDA initializes.
double torch_memory_fraction() {
#if GMLAKE_TORCH_VERSION_NUM >= 211
  return c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::per_process_memory_fraction();
#else
  return 1.0;
#endif
}

bool torch_capture_reuse() {
#if GMLAKE_TORCH_VERSION_NUM >= 211
  return c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
#else
  return false;
#endif
}

// PyTorch's round_size for `divisions` > 1 (roundup_power2_divisions): the next of
// `divisions` equal steps between the size's power of two and the next one.
uint64_t round_size_with(uint64_t size, uint64_t divisions) {
  constexpr uint64_t kMin = 512;
  if (size < kMin) {
    return kMin;
  }
  if (divisions > 1 && size > kMin * divisions) {
    if ((size & (size - 1)) == 0) {
      return size;
    }
    const uint64_t floor = uint64_t{1} << (63 - __builtin_clzll(size));
    const uint64_t step = floor >> (63 - __builtin_clzll(divisions));
    if (step == 0) {
      return floor << 1;
    }
    const uint64_t down = size & ~(step - 1);
    return down == size ? size : down + step;
  }
  return (size + kMin - 1) / kMin * kMin;
}

std::atomic<Impl*> g_instance{nullptr};

uint64_t as_u64(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

uint64_t stream_id(cudaStream_t s) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s));
}

std::string human_bytes(uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(b) / (1ull << 30));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(b) / (1ull << 20));
  }
  return buf;
}

} // namespace

namespace {
std::atomic<TierRelief> g_tier_relief{nullptr};
} // namespace

void set_tier_relief(TierRelief relief) {
  g_tier_relief.store(relief, std::memory_order_release);
}

void local_raw_delete(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  Impl* impl = Impl::instance();
  if (impl != nullptr) {
    impl->free(ptr);
  }
}

Impl::Impl(std::string conf) : conf_(std::move(conf)) {
  Impl* expected = nullptr;
  // One instance per process: the first one constructed is the one the deleter uses.
  g_instance.compare_exchange_strong(expected, this);
}

Impl* Impl::instance() {
  return g_instance.load(std::memory_order_acquire);
}

// ---------------------------------------------------------------------------------------------
// Devices

void Impl::init(int device_count) {
  TORCH_CHECK(
      device_count >= 0 && device_count <= kMaxDevices,
      "gmlake: unsupported device count ",
      device_count);
  // Makes torch parse its allocator settings now, so an invalid value is an error when CUDA
  // initializes, as with PyTorch's allocator.
  (void)torch_memory_fraction();
  std::lock_guard<std::mutex> g(create_mu_);
  for (int i = 0; i < device_count; ++i) {
    if (!devices_[i]) {
      auto ds = std::make_unique<DeviceState>();
      ds->index = i;
      devices_[i] = std::move(ds);
    }
  }
  if (device_count > device_count_.load()) {
    device_count_.store(device_count, std::memory_order_release);
  }
}

Impl::DeviceState& Impl::state(int device) {
  TORCH_CHECK(
      device >= 0 && device < device_count_.load(std::memory_order_acquire) && devices_[device],
      "gmlake: allocator not initialized for device ",
      device,
      " (",
      device_count_.load(),
      " device(s) initialized): did CUDA initialize?");
  return *devices_[device];
}

const ffi::Gmlake* Impl::core_if_created(int device) {
  if (device < 0 || device >= device_count_.load(std::memory_order_acquire) || !devices_[device]) {
    return nullptr;
  }
  return devices_[device]->core.load(std::memory_order_acquire);
}

const ffi::Gmlake& Impl::core(int device) {
  DeviceState& ds = state(device);
  ffi::Gmlake* c = ds.core.load(std::memory_order_acquire);
  if (C10_LIKELY(c != nullptr)) {
    return *c;
  }
  std::lock_guard<std::mutex> g(create_mu_);
  c = ds.core.load(std::memory_order_acquire);
  if (c != nullptr) {
    return *c;
  }
  // PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction, as PyTorch's allocator applies it
  // to each device (gmlake's own memory_fraction, when set, wins).
  const double torch_fraction = torch_memory_fraction();
  try {
    // The Rust side retains the device's primary context (the runtime's) and makes it
    // current around its own driver calls.
    rust::Box<ffi::Gmlake> box = ffi::new_cuda_allocator(device, rust::Str(conf_));
    if (history_.tracing()) {
      box->set_history(1 << 16);
    }
    if (torch_fraction < 1.0 && box->memory_fraction() < 0) {
      box->set_memory_fraction(torch_fraction);
    }
    ds.page_size.store(box->page_size(), std::memory_order_release);
    const uint32_t mode = box->debug_mode();
    if (mode != 0) {
      ds.debug = std::make_unique<DebugDevice>(device, mode);
      std::fprintf(stderr, "[gmlake] memory debugging mode on for device %d: %s\n", device,
                   settings_string().c_str());
    }
    c = box.into_raw();
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: cannot create the allocator of CUDA device ", device, ": ", e.what());
  }
  // Leaked on purpose: the allocator lives as long as the process (tensors may be freed
  // during interpreter shutdown).
  ds.core.store(c, std::memory_order_release);
  created_.fetch_add(1);
  return *c;
}

int Impl::owner_of(const void* ptr) {
  const int n = device_count_.load(std::memory_order_acquire);
  if (created_.load(std::memory_order_acquire) <= 1) {
    for (int d = 0; d < n; ++d) {
      if (core_if_created(d) != nullptr) {
        return d;
      }
    }
    return -1;
  }
  // Several devices in use: ask the runtime which device the address belongs to.
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err == cudaSuccess && attr.type == cudaMemoryTypeDevice && attr.device >= 0 &&
      attr.device < n && core_if_created(attr.device) != nullptr) {
    return attr.device;
  }
  (void)cudaGetLastError();
  // Fall back on asking each allocator.
  for (int d = 0; d < n; ++d) {
    const ffi::Gmlake* c = core_if_created(d);
    if (c != nullptr) {
      try {
        if (c->allocation(as_u64(ptr)).found) {
          return d;
        }
      } catch (const std::exception&) {
      }
    }
  }
  return -1;
}

// ---------------------------------------------------------------------------------------------
// History

void Impl::drain(DeviceState& ds, const ContextPtr& alloc_ctx, const ContextPtr& free_ctx) {
  // Caller holds ds.hist.mu.
  ffi::Gmlake* c = ds.core.load(std::memory_order_acquire);
  if (c == nullptr) {
    return;
  }
  rust::Vec<ffi::TraceRecord> events;
  try {
    events = c->take_history();
  } catch (const rust::Error& e) {
    log_once("take_history", std::string("gmlake: cannot read the allocator's history: ") + e.what());
    return;
  }
  history_.drain(ds.hist, ds.index, events, alloc_ctx, free_ctx);
}

void Impl::refresh_tracing() {
  if (!history_.refresh()) {
    return;
  }
  const bool on = history_.tracing();
  const int n = device_count_.load();
  for (int d = 0; d < n; ++d) {
    ffi::Gmlake* c = devices_[d] ? devices_[d]->core.load() : nullptr;
    if (c != nullptr) {
      std::lock_guard<std::mutex> g(devices_[d]->hist.mu);
      try {
        c->set_history(on ? (1 << 16) : 0);
      } catch (const rust::Error& e) {
        TORCH_CHECK(false, "gmlake: ", e.what());
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Allocation

void* Impl::malloc_on(int device, size_t nbytes, cudaStream_t stream) {
  const ffi::Gmlake& c = core(device);
  DeviceState& ds = *devices_[device];

  // CUDA graph capture (or use_mem_pool): route to the pool whose filter accepts the stream.
  // The innermost routing whose filter accepts the stream wins (nested use_mem_pool blocks
  // and captures form a stack, as in PyTorch's allocator).
  DevicePools::Route route;
  if (C10_UNLIKELY(ds.pools.routing())) {
    route = ds.pools.route(stream);
  }
  const bool in_pool = route.in_pool;
  const bool no_split = route.no_split;
  const PoolId pool = route.pool;
  if (C10_UNLIKELY(in_pool && ds.pools.has_deferred())) {
    ds.pools.free_safe_blocks(c, stream, log_);
  }

  // Rounding the core is not told about by its configuration: PyTorch's
  // roundup_power2_divisions (torch's settings, changeable at run time), and whole pages for
  // a pool without splitting. 0: the core's own (512 bytes).
  uint64_t rounded = 0;
  if (nbytes > 0) {
    const size_t divisions = torch_roundup_divisions(nbytes);
    if (C10_UNLIKELY(divisions > 1)) {
      rounded = round_size_with(nbytes, divisions);
    }
    if (C10_UNLIKELY(no_split)) {
      const uint64_t page = std::max<uint64_t>(ds.page_size.load(std::memory_order_acquire), 512);
      const uint64_t want = std::max<uint64_t>(rounded, nbytes);
      rounded = (want + page - 1) / page * page;
    }
  }

  const uint64_t sid = stream_id(stream);
  auto call = [&]() -> ffi::AllocOutcome {
    // While a graph may be capturing (in cudaStreamCaptureModeGlobal, PyTorch's default),
    // the driver calls that create and map memory must run in relaxed mode, as PyTorch's
    // allocator does for cudaMalloc (memory created during a capture is kept until the graph
    // is released, so the graph's baked-in addresses stay valid).
    std::optional<c10::cuda::CUDAStreamCaptureModeGuard> relaxed;
    if (C10_UNLIKELY(ds.pools.routing())) {
      relaxed.emplace(cudaStreamCaptureModeRelaxed);
    }
    if (C10_UNLIKELY(rounded != 0)) {
      return c.allocate_rounded(nbytes, rounded, sid, pool.first, pool.second, in_pool);
    }
    return in_pool ? c.allocate_in_pool(nbytes, sid, pool.first, pool.second)
                   : c.allocate(nbytes, sid);
  };

  ffi::AllocOutcome r;
  ContextPtr debug_ctx;
  if (C10_LIKELY(!history_.tracing())) {
    r = call();
  } else {
    ContextPtr ctx = history_.gather(When::STATE);
    std::lock_guard<std::mutex> g(ds.hist.mu);
    r = call();
    drain(ds, ctx, nullptr);
    if (r.status == ffi::AllocStatus::Allocated && r.ptr != 0 && ctx) {
      ds.hist.contexts[r.ptr] = ctx;
    }
    debug_ctx = std::move(ctx);
  }

  if (C10_UNLIKELY(r.status == ffi::AllocStatus::OutOfMemory) && !in_pool && !ds.pools.routing()) {
    // The host tier may free memory (evictions whose copies complete, more evictions); not
    // while a graph may be capturing (it waits for the device).
    TierRelief relief = g_tier_relief.load(std::memory_order_acquire);
    if (relief != nullptr && relief(device, nbytes)) {
      r = call();
    }
  }
  if (C10_LIKELY(r.status == ffi::AllocStatus::Allocated)) {
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(r.ptr));
    // Debug mode (not during a capture: no work may be queued on a capturing stream, and no
    // event queried): fill the canary of the new block, check those of freed ones.
    if (C10_UNLIKELY(ds.debug != nullptr) && p != nullptr && !in_pool &&
        !ds.pools.routing()) {
      try {
        ffi::AllocationRecord a = c.allocation(r.ptr);
        if (a.found) {
          ds.debug->on_alloc(r.ptr, a.size, a.requested, stream, std::move(debug_ctx));
        }
      } catch (const std::exception&) {
      }
      debug_poll(ds, false);
    }
    if (p != nullptr) {
      compat::trace_gpu_alloc(p);
      if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
        try {
          ffi::Stats s = c.stats();
          c10::reportMemoryUsageToProfiler(
              p,
              static_cast<int64_t>(nbytes),
              static_cast<size_t>(s.allocated_bytes[0].current),
              static_cast<size_t>(s.reserved_bytes[0].current),
              c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
        } catch (const rust::Error&) {
        }
      }
    }
    return p;
  }
  if (r.status == ffi::AllocStatus::OutOfMemory) {
    raise_oom(device, r, nbytes, stream);
  }
  TORCH_CHECK(
      false,
      "gmlake: allocation of ",
      nbytes,
      " bytes on CUDA device ",
      device,
      " failed: ",
      std::string(r.message));
}

void Impl::raise_oom(int device, const ffi::AllocOutcome& r, size_t nbytes, cudaStream_t stream) {
  const std::vector<OomObserver> observers = history_.oom_observers();
  const uint64_t total = r.limit != 0 ? r.limit : r.device_total;
  for (const auto& obs : observers) {
    obs(device, static_cast<size_t>(r.allocated), static_cast<size_t>(total),
        static_cast<size_t>(r.device_free));
  }
  c10::reportOutOfMemoryToProfiler(
      static_cast<int64_t>(nbytes),
      static_cast<size_t>(r.allocated),
      static_cast<size_t>(r.reserved),
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  // PyTorch's sentence first ("Tried to allocate X. GPU N has a total capacity of ..."), which
  // tools and tests match; the core's message says "GPU has", given the device index here.
  std::string msg = std::string(r.message);
  const std::string gpu_has = "GPU has a total capacity";
  if (auto at = msg.find(gpu_has); at != std::string::npos) {
    msg.replace(at, gpu_has.size(), "GPU " + std::to_string(device) + " has a total capacity");
  }
  TORCH_CHECK_WITH(
      OutOfMemoryError,
      false,
      "CUDA out of memory. ",
      msg,
      ". (gmlake allocator) Including memory not managed by gmlake, the device has ",
      human_bytes(r.device_free),
      " free of ",
      human_bytes(r.device_total),
      ".");
}

c10::DataPtr Impl::allocate(size_t nbytes) {
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  void* p = malloc_on(device, nbytes, stream);
  return {p, p, &local_raw_delete, c10::Device(c10::DeviceType::CUDA, device)};
}

void* Impl::raw_alloc(size_t nbytes) {
  if (nbytes == 0) {
    return nullptr;
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  return malloc_on(device, nbytes, stream);
}

void* Impl::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) {
    return nullptr;
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return malloc_on(device, nbytes, stream);
}

void Impl::free(void* ptr) noexcept {
  if (ptr == nullptr) {
    return;
  }
  try {
    const int device = owner_of(ptr);
    if (device < 0) {
      log_once(
          "foreign-free",
          "ignoring a free of a pointer that gmlake did not allocate (allocated before gmlake "
          "was installed?)");
      return;
    }
    DeviceState& ds = *devices_[device];
    const ffi::Gmlake& c = *ds.core.load(std::memory_order_acquire);
    const uint64_t p = as_u64(ptr);
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      try {
        ffi::AllocationRecord a = c.allocation(p);
        ffi::Stats s = c.stats();
        if (a.found) {
          c10::reportMemoryUsageToProfiler(
              ptr,
              -static_cast<int64_t>(a.requested),
              static_cast<size_t>(s.allocated_bytes[0].current - static_cast<int64_t>(a.size)),
              static_cast<size_t>(s.reserved_bytes[0].current),
              c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
        }
      } catch (const std::exception&) {
      }
    }
    std::optional<c10::cuda::CUDAStreamCaptureModeGuard> relaxed;
    if (C10_UNLIKELY(ds.pools.routing())) {
      relaxed.emplace(cudaStreamCaptureModeRelaxed);
      // A block used on other streams, freed during a capture: held until the graph orders
      // those uses before later work (graph_capture_record_stream_reuse), as PyTorch's.
      if (torch_capture_reuse() && ds.pools.defer_free(c, p)) {
        compat::trace_gpu_free(ptr);
        return;
      }
    }
    const bool debug = C10_UNLIKELY(ds.debug != nullptr) && !ds.pools.routing();
    if (debug) {
      // The canary copy and the poison are queued on the block's stream before the core
      // frees it (and may hand it out again).
      c10::cuda::CUDAGuard dg(static_cast<c10::DeviceIndex>(device));
      ds.debug->on_free(p);
    }
    ffi::FreeOutcome r;
    if (C10_LIKELY(!history_.tracing())) {
      r = c.free_ptr(p);
    } else {
      ContextPtr ctx = history_.gather(When::ALL);
      std::lock_guard<std::mutex> g(ds.hist.mu);
      r = c.free_ptr(p);
      drain(ds, nullptr, ctx);
      ds.hist.contexts.erase(p);
    }
    if (debug) {
      debug_poll(ds, false);
    }
    switch (r.status) {
      case ffi::FreeStatus::Done:
        compat::trace_gpu_free(ptr);
        break;
      case ffi::FreeStatus::UnknownPointer:
        log_once(
            "foreign-free",
            "ignoring a free of a pointer that gmlake did not allocate (allocated before gmlake "
            "was installed?): " +
                std::string(r.message));
        return;
      case ffi::FreeStatus::DoubleFree:
        std::fprintf(stderr, "[gmlake] warning: %s\n", std::string(r.message).c_str());
        return;
      default:
        std::fprintf(stderr, "[gmlake] error while freeing %p: %s\n", ptr, std::string(r.message).c_str());
        return;
    }
    if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
      // Caching disabled (torch.cuda.memory.caching_allocator_enable(False)): give the
      // memory back at once, as PyTorch's uncached mode does.
      try {
        c.empty_cache();
      } catch (const rust::Error& e) {
        log_once("uncached-empty", std::string("gmlake: empty_cache after free failed: ") + e.what());
      }
    }
  } catch (const std::exception& e) {
    try {
      std::fprintf(stderr, "[gmlake] error while freeing %p: %s\n", ptr, e.what());
    } catch (...) {
    }
  } catch (...) {
    std::fprintf(stderr, "[gmlake] unknown error while freeing %p\n", ptr);
  }
}

void Impl::record_stream(void* ptr, c10::DeleterFnPtr deleter, int device, cudaStream_t stream) {
  if (ptr == nullptr) {
    return;
  }
  // Not ours (e.g. a tensor shared from another process, or from_blob): nothing to do, as
  // PyTorch's allocator.
  if (deleter != &local_raw_delete) {
    return;
  }
  int d = device;
  if (core_if_created(d) == nullptr) {
    d = owner_of(ptr);
  }
  if (d < 0 || core_if_created(d) == nullptr) {
    log_once("foreign-record", "ignoring record_stream on a pointer that gmlake did not allocate");
    return;
  }
  if (C10_UNLIKELY(devices_[d]->debug != nullptr)) {
    devices_[d]->debug->on_record_stream(as_u64(ptr));
  }
  ffi::FreeOutcome r = core_if_created(d)->record_stream(as_u64(ptr), stream_id(stream));
  if (r.status == ffi::FreeStatus::UnknownPointer) {
    log_once(
        "foreign-record",
        "ignoring record_stream on a pointer that gmlake did not allocate: " + std::string(r.message));
    return;
  }
  TORCH_CHECK(r.status == ffi::FreeStatus::Done, "gmlake: record_stream failed: ", std::string(r.message));
}

void* Impl::base_allocation(void* ptr, size_t* size) {
  const int d = owner_of(ptr);
  if (d >= 0) {
    ffi::AllocationRecord a;
    try {
      a = core_if_created(d)->allocation(as_u64(ptr));
    } catch (const rust::Error& e) {
      TORCH_CHECK(false, "gmlake: ", e.what());
    }
    if (a.found) {
      if (size != nullptr) {
        *size = static_cast<size_t>(a.size);
      }
      return reinterpret_cast<void*>(static_cast<uintptr_t>(a.ptr));
    }
  }
  log_once(
      "foreign-base",
      "getBaseAllocation on a pointer that gmlake did not allocate: returning the pointer itself "
      "with size 0");
  if (size != nullptr) {
    *size = 0;
  }
  return ptr;
}

void Impl::copy_data(void* dest, const void* src, size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

// ---------------------------------------------------------------------------------------------
// Caching

void Impl::empty_cache(PoolId /*pool*/) {
  // The core returns every cached page it may (pages of live graph pools stay mapped, since a
  // replay uses their addresses), whichever pool is named.
  const int n = device_count_.load();
  for (int d = 0; d < n; ++d) {
    const ffi::Gmlake* c = core_if_created(d);
    if (c == nullptr) {
      // PyTorch's allocator synchronizes every initialized device here (num_sync_all_streams),
      // whether it allocated on it or not.
      if (devices_[d] && !devices_[d]->pools.routing()) {
        devices_[d]->syncs_without_core.fetch_add(1);
      }
      continue;
    }
    DeviceState& ds = *devices_[d];
    try {
      if (history_.tracing()) {
        ContextPtr ctx = history_.gather(When::ALLOC);
        std::lock_guard<std::mutex> g(ds.hist.mu);
        c->empty_cache();
        drain(ds, ctx, nullptr);
      } else {
        c->empty_cache();
      }
    } catch (const rust::Error& e) {
      TORCH_CHECK(false, "gmlake: empty_cache on device ", d, " failed: ", e.what());
    }
  }
}

void Impl::cache_info(int device, size_t* largest_block) {
  TORCH_CHECK(largest_block != nullptr, "gmlake: cacheInfo needs an output pointer");
  const ffi::Gmlake& c = core(device);
  try {
    ffi::CacheInfoRecord ci = c.cache_info();
    size_t candidate = *largest_block;
    if (candidate == 0) {
      // As PyTorch: start from what the device can still hand out; gmlake can add every cached
      // page to a new mapping (a stitch), so cached bytes count too, where stitching is on.
      ffi::MemInfo mi = c.memory_info();
      uint64_t free_bytes = mi.free;
      const uint64_t limit = c.limit();
      if (limit != 0) {
        const uint64_t reserved = c.reserved_bytes();
        free_bytes = std::min<uint64_t>(free_bytes, limit > reserved ? limit - reserved : 0);
      }
      const uint64_t page = c.page_size();
      if (page != 0) {
        free_bytes = free_bytes / page * page;
      }
      candidate = static_cast<size_t>(free_bytes);
      if (c.may_stitch(candidate + ci.cached_free_bytes)) {
        candidate += static_cast<size_t>(ci.cached_free_bytes);
      }
    }
    *largest_block = std::max<size_t>(candidate, static_cast<size_t>(ci.largest_free_block));
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: cacheInfo on device ", device, " failed: ", e.what());
  }
}

void Impl::set_memory_fraction(double fraction, int device) {
  TORCH_CHECK(
      fraction >= 0 && fraction <= 1,
      "invalid fraction: ",
      fraction,
      ". Please set within [0, 1].");
  const ffi::Gmlake& c = core(device);
  try {
    // 0 allows nothing new, as PyTorch's; get_per_process_memory_fraction reports it back.
    c.set_memory_fraction(fraction);
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

double Impl::memory_fraction(int device) {
  const ffi::Gmlake& c = core(device);
  try {
    const double f = c.memory_fraction();
    return f < 0 ? 1.0 : f;
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// Statistics and snapshots

ffi::Stats Impl::stats(int device, bool* present) {
  DeviceState& ds = state(device); // checks the index
  const int64_t early_syncs = ds.syncs_without_core.load();
  const ffi::Gmlake* c = core_if_created(device);
  if (c == nullptr) {
    ffi::Stats s{};
    s.num_sync_all_streams = early_syncs;
    s.max_split_size = std::numeric_limits<int64_t>::max();
    *present = early_syncs != 0;
    return s;
  }
  *present = true;
  try {
    ffi::Stats s = c->stats();
    s.num_sync_all_streams += early_syncs;
    return s;
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: ", e.what());
  }
}

void Impl::reset_accumulated_stats(int device) {
  state(device).syncs_without_core.store(0);
  const ffi::Gmlake* c = core_if_created(device);
  if (c != nullptr) {
    try {
      c->reset_accumulated_stats();
    } catch (const rust::Error& e) {
      TORCH_CHECK(false, "gmlake: ", e.what());
    }
  }
}

void Impl::reset_peak_stats(int device) {
  state(device);
  const ffi::Gmlake* c = core_if_created(device);
  if (c != nullptr) {
    try {
      c->reset_peak_stats();
    } catch (const rust::Error& e) {
      TORCH_CHECK(false, "gmlake: ", e.what());
    }
  }
}

std::string Impl::stats_json(int device) {
  state(device);
  const ffi::Gmlake* c = core_if_created(device);
  if (c == nullptr) {
    return std::string(ffi::empty_stats_json());
  }
  try {
    return std::string(c->stats_json());
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: ", e.what());
  }
}

std::string Impl::snapshot_json(int device) {
  state(device);
  const ffi::Gmlake* c = core_if_created(device);
  if (c == nullptr) {
    return "{}";
  }
  try {
    return std::string(c->snapshot_json());
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: ", e.what());
  }
}

std::string Impl::settings_string() {
  std::ostringstream out;
  out << "backend:gmlake";
  try {
    rust::Vec<ffi::KeyValue> kv;
    const ffi::Gmlake* c = nullptr;
    for (int d = 0; d < device_count_.load() && c == nullptr; ++d) {
      c = core_if_created(d);
    }
    kv = c != nullptr ? c->config() : ffi::check_conf(rust::Str(conf_));
    for (const auto& p : kv) {
      out << "," << std::string(p.key) << ":" << std::string(p.value);
    }
  } catch (const rust::Error& e) {
    out << ",error:" << e.what();
  }
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Memory debugging mode

void Impl::debug_poll(DeviceState& ds, bool wait) noexcept {
  if (ds.debug == nullptr) {
    return;
  }
  std::vector<DebugReport> found = ds.debug->poll(wait);
  if (found.empty()) {
    return;
  }
  try {
    ffi::Gmlake* c = ds.core.load(std::memory_order_acquire);
    const auto [keep, cap] = history_.keep();
    for (auto& r : found) {
      std::fprintf(stderr, "[gmlake] debug mode: %s\n", r.message.c_str());
      std::fflush(stderr);
      if (c != nullptr) {
        try {
          c->debug_canary_error(rust::Str(r.message));
        } catch (const rust::Error&) {
        }
      }
      // The allocation's stack goes into the history as a "snapshot" entry at the block's
      // address, which torch symbolizes; gmlake.debug_report() takes its frames from there.
      if (keep && cap > 0 && r.context) {
        std::lock_guard<std::mutex> g(ds.hist.mu);
        History::keep_capped(ds.hist, TraceRec{
            Action::SNAPSHOT,
            ds.index,
            r.address,
            r.requested,
            reinterpret_cast<void*>(static_cast<uintptr_t>(r.stream)),
            PoolId{0, 0},
            c10::getApproximateTime(),
            r.context,
            std::string(),
            std::string()}, cap);
      }
      std::lock_guard<std::mutex> g(debug_mu_);
      r.id = debug_reports_.size() + 1;
      r.context.reset();
      debug_reports_.push_back(std::move(r));
    }
  } catch (...) {
  }
}

size_t Impl::debug_check(bool wait) {
  const int n = device_count_.load();
  for (int d = 0; d < n; ++d) {
    if (core_if_created(d) != nullptr && devices_[d]->debug != nullptr) {
      c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(d));
      debug_poll(*devices_[d], wait);
    }
  }
  std::lock_guard<std::mutex> g(debug_mu_);
  return debug_reports_.size();
}

std::string Impl::debug_reports_json() {
  std::lock_guard<std::mutex> g(debug_mu_);
  std::ostringstream out;
  out << "[";
  bool first = true;
  for (const auto& r : debug_reports_) {
    out << (first ? "" : ",") << "{\"id\":" << r.id << ",\"kind\":\"" << r.kind
        << "\",\"device\":" << r.device << ",\"address\":" << r.address
        << ",\"requested\":" << r.requested << ",\"size\":" << r.size
        << ",\"stream\":" << r.stream << ",\"first_bad\":" << r.first_bad
        << ",\"bad_bytes\":" << r.bad_bytes << ",\"canary_bytes\":" << r.canary_bytes
        << ",\"message\":\"";
    for (char ch : r.message) {
      if (ch == '"' || ch == '\\') {
        out << '\\';
      }
      out << (static_cast<unsigned char>(ch) < 0x20 ? ' ' : ch);
    }
    out << "\"}";
    first = false;
  }
  out << "]";
  return out.str();
}

uint32_t Impl::debug_mode() {
  const int n = device_count_.load();
  for (int d = 0; d < n; ++d) {
    if (core_if_created(d) != nullptr && devices_[d]->debug != nullptr) {
      return devices_[d]->debug->mode();
    }
  }
  return 0;
}

SnapshotData Impl::snapshot(PoolId pool, bool include_traces) {
  SnapshotData out;
  const bool filter = pool != PoolId{0, 0};
  const int n = device_count_.load();
  out.traces.resize(static_cast<size_t>(n));
  for (int d = 0; d < n; ++d) {
    const ffi::Gmlake* c = core_if_created(d);
    if (c == nullptr) {
      continue;
    }
    DeviceState& ds = *devices_[d];
    ffi::SnapshotRecord snap;
    try {
      snap = c->snapshot();
    } catch (const rust::Error& e) {
      TORCH_CHECK(false, "gmlake: snapshot of device ", d, " failed: ", e.what());
    }
    std::lock_guard<std::mutex> g(ds.hist.mu);
    for (const auto& seg : snap.segments) {
      if (filter && (seg.pool_first != pool.first || seg.pool_second != pool.second)) {
        continue;
      }
      SegmentRec s;
      s.device = d;
      s.address = seg.address;
      s.total_size = seg.total_size;
      s.requested_size = seg.requested_size;
      s.allocated_size = seg.allocated_size;
      s.active_size = seg.active_size;
      s.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(seg.stream));
      s.is_large = seg.is_large;
      s.stitched = seg.stitched;
      s.pool = PoolId{seg.pool_first, seg.pool_second};
      // Blocks in address order, gaps filled with inactive blocks, clipped to the segment, so
      // that PyTorch's address arithmetic (segment address + sizes so far) holds.
      std::vector<const ffi::BlockRecord*> blocks;
      blocks.reserve(seg.blocks.size());
      for (const auto& b : seg.blocks) {
        blocks.push_back(&b);
      }
      std::sort(blocks.begin(), blocks.end(), [](auto* a, auto* b) { return a->address < b->address; });
      const uint64_t end = seg.address + seg.total_size;
      uint64_t at = seg.address;
      for (const auto* b : blocks) {
        if (b->address < at || b->address >= end) {
          continue; // overlapping or outside: not representable
        }
        if (b->address > at) {
          BlockRec gap;
          gap.size = b->address - at;
          s.blocks.push_back(gap);
        }
        BlockRec br;
        br.size = std::min<uint64_t>(b->size, end - b->address);
        br.requested_size = b->requested_size;
        br.allocated = b->state == ffi::BlockState::ActiveAllocated;
        br.active = b->state != ffi::BlockState::Inactive;
        br.stitched = b->stitched;
        if (br.allocated) {
          auto it = ds.hist.contexts.find(b->address);
          if (it != ds.hist.contexts.end()) {
            br.context = it->second;
          }
        }
        s.blocks.push_back(std::move(br));
        at = b->address + s.blocks.back().size;
      }
      if (at < end) {
        BlockRec gap;
        gap.size = end - at;
        s.blocks.push_back(gap);
      }
      out.segments.push_back(std::move(s));
    }
    if (include_traces) {
      out.traces[static_cast<size_t>(d)].assign(ds.hist.trace.begin(), ds.hist.trace.end());
      out.annotations.insert(out.annotations.end(), ds.hist.annotations.begin(), ds.hist.annotations.end());
    }
  }
  out.settings = settings_string();
  return out;
}

// ---------------------------------------------------------------------------------------------
// CUDA graph pools

void Impl::begin_allocate_to_pool(int device, PoolId pool, StreamFilter filter) {
  const ffi::Gmlake& c = core(device);
  devices_[device]->pools.begin(c, pool, std::move(filter));
}

void Impl::end_allocate_to_pool(int device, PoolId pool) {
  const ffi::Gmlake& c = core(device);
  devices_[device]->pools.end(c, pool, log_);
}

void Impl::release_pool(int device, PoolId pool) noexcept {
  // Called from CUDAGraph's destructor: must not throw.
  try {
    const ffi::Gmlake* c = core_if_created(device);
    if (c == nullptr) {
      return;
    }
    devices_[device]->pools.release(*c, pool, log_);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[gmlake] releasePool failed: %s\n", e.what());
  }
}

void Impl::create_or_incref_pool(int device, PoolId pool) {
  core(device);
  devices_[device]->pools.incref(pool);
}

void Impl::set_no_split(int device, PoolId pool) {
  core(device);
  devices_[device]->pools.set_no_split(pool);
}

int Impl::pool_use_count(int device, PoolId pool) {
  if (core_if_created(device) == nullptr) {
    return 0;
  }
  return devices_[device]->pools.use_count(pool);
}

std::vector<Impl::PoolBlock> Impl::live_blocks_in_pool(int device, PoolId pool) {
  const ffi::Gmlake& c = core(device);
  ffi::SnapshotRecord snap;
  try {
    snap = c.snapshot();
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: ", e.what());
  }
  std::vector<PoolBlock> out;
  for (const auto& seg : snap.segments) {
    if (seg.pool_first != pool.first || seg.pool_second != pool.second) {
      continue;
    }
    for (const auto& b : seg.blocks) {
      if (b.state == ffi::BlockState::ActiveAllocated) {
        out.push_back(PoolBlock{b.address, b.size, b.requested_size, seg.stream});
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const PoolBlock& x, const PoolBlock& y) { return x.address < y.address; });
  return out;
}

bool Impl::check_pool_live_allocations(
    int device,
    PoolId pool,
    const std::vector<void*>& expected_live) {
  std::unordered_set<uint64_t> expected;
  for (void* p : expected_live) {
    expected.insert(as_u64(p));
  }
  const auto live = live_blocks_in_pool(device, pool);
  if (live.size() != expected.size()) {
    return false;
  }
  for (const auto& b : live) {
    if (expected.count(b.address) == 0) {
      return false;
    }
  }
  return true;
}

std::vector<void*> Impl::restore_pool_checkpoint(
    int device,
    PoolId pool,
    const std::vector<PoolBlock>& checkpoint) {
  const ffi::Gmlake& c = core(device);
  DeviceState& ds = *devices_[device];
  std::map<uint64_t, PoolBlock> now;
  for (const auto& b : live_blocks_in_pool(device, pool)) {
    now.emplace(b.address, b);
  }
  std::vector<const PoolBlock*> missing;
  for (const auto& b : checkpoint) {
    auto it = now.find(b.address);
    if (it != now.end() && it->second.size == b.size) {
      now.erase(it); // allocated then and now: unchanged
    } else {
      missing.push_back(&b);
    }
  }
  // Blocks allocated since the checkpoint are freed first (the caller passes their storages
  // as stale), so that their ranges are free for the blocks to re-create.
  std::vector<void*> freed;
  for (const auto& kv : now) {
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(kv.first));
    free(p);
    freed.push_back(p);
  }
  for (const PoolBlock* b : missing) {
    try {
      if (history_.tracing()) {
        std::lock_guard<std::mutex> g(ds.hist.mu);
        c.allocate_at(b->address, b->size, b->requested, b->stream, pool.first, pool.second);
        drain(ds, nullptr, nullptr);
      } else {
        c.allocate_at(b->address, b->size, b->requested, b->stream, pool.first, pool.second);
      }
    } catch (const rust::Error& e) {
      TORCH_CHECK(
          false,
          "gmlake: cannot restore the CUDA graph pool checkpoint (setCheckpointPoolState): the "
          "block at ",
          reinterpret_cast<void*>(static_cast<uintptr_t>(b->address)),
          " of ",
          b->size,
          " bytes cannot be allocated again: ",
          e.what());
    }
  }
  return freed;
}

// ---------------------------------------------------------------------------------------------
// History

void Impl::record_history(
    bool enabled,
    ContextRecorder recorder,
    size_t max_entries,
    When when,
    bool clear,
    const std::vector<Action>& skip) {
  history_.configure(enabled, recorder, max_entries, when, skip);
  if (!enabled || clear) {
    const int n = device_count_.load();
    for (int d = 0; d < n; ++d) {
      if (devices_[d]) {
        DeviceHistory& dh = devices_[d]->hist;
        std::lock_guard<std::mutex> g(dh.mu);
        dh.trace.clear();
        dh.annotations.clear();
        if (!enabled) {
          dh.contexts.clear();
        }
      }
    }
  }
  refresh_tracing();
}

bool Impl::history_enabled() {
  return history_.enabled();
}

void Impl::record_annotation(std::vector<std::pair<std::string, std::string>> md) {
  if (!history_.enabled()) {
    return;
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  if (device < 0 || device >= device_count_.load() || !devices_[device]) {
    return;
  }
  history_.annotate(devices_[device]->hist, device, std::move(md));
}

void Impl::push_compile_context(std::string ctx) {
  history_.push_compile_context(std::move(ctx));
}

void Impl::pop_compile_context() {
  history_.pop_compile_context();
}

void Impl::set_user_metadata(std::string md) {
  history_.set_user_metadata(std::move(md));
}

std::string Impl::user_metadata() {
  return history_.user_metadata();
}

void Impl::attach_oom_observer(OomObserver obs) {
  history_.attach_oom_observer(std::move(obs));
}

void Impl::attach_trace_tracker(TraceTracker tracker) {
  history_.attach_trace_tracker(std::move(tracker));
  refresh_tracing();
}

// ---------------------------------------------------------------------------------------------
// CUDA IPC

std::pair<int64_t, std::string> Impl::share_ipc(void* ptr) {
  const int d = owner_of(ptr);
  TORCH_CHECK(
      d >= 0,
      "gmlake: shareIpcHandle: device pointer ", ptr,
      " was not allocated by gmlake (allocated before gmlake was installed?)");
  try {
    ffi::IpcShare s = core(d).share_ipc(reinterpret_cast<uint64_t>(ptr));
    std::string bytes(s.handle.begin(), s.handle.end());
    return {static_cast<int64_t>(s.offset), std::move(bytes)};
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: shareIpcHandle(", ptr, ") on device ", d, ": ", e.what());
  }
}

std::shared_ptr<void> Impl::get_ipc_dev_ptr(const std::string& handle) {
  const rust::Slice<const uint8_t> bytes(
      reinterpret_cast<const uint8_t*>(handle.data()), handle.size());
  ffi::IpcHandleKind kind = ffi::IpcHandleKind::Pages;
  try {
    kind = ffi::ipc_handle_kind(bytes);
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: getIpcDevPtr: ", e.what());
  }
  if (kind == ffi::IpcHandleKind::CudaMalloc) {
    return open_cuda_ipc_handle(handle.substr(2));
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  const int d = device;
  return ipc_.cached(handle, [&]() -> std::shared_ptr<void> {
    uint64_t base = 0;
    try {
      base = core(d).open_ipc(bytes);
    } catch (const rust::Error& e) {
      TORCH_CHECK(false, "gmlake: getIpcDevPtr on device ", d, ": ", e.what());
    }
    return std::shared_ptr<void>(reinterpret_cast<void*>(base), [this, d, handle](void* p) {
      ipc_.forget(handle);
      try {
        // Stream-ordered, as PyTorch's deleter of received memory is (it then synchronizes
        // its current stream): the range is unmapped once the work queued on this stream has
        // completed, by a later allocator call. Nothing waits here (the GIL may be held).
        const auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(d));
        core(d).close_ipc(
            reinterpret_cast<uint64_t>(p), stream_id(stream.stream()));
      } catch (const std::exception& e) {
        log_once("close_ipc", std::string("gmlake: closing imported CUDA memory failed: ") + e.what());
      }
    });
  });
}

std::shared_ptr<void> Impl::open_cuda_ipc_handle(const std::string& raw) {
  return ipc_.open_cuda(raw, log_);
}

// ---------------------------------------------------------------------------------------------
// Peers and copies

void Impl::enable_peer_access(int dev, int dev_to_access) {
  {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  // gmlake's memory is mapped with cuMemMap: peer access is granted per mapping.
  const ffi::Gmlake& c = core(dev_to_access);
  try {
    c.add_peer(dev);
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: enablePeerAccess(", dev, ", ", dev_to_access, "): ", e.what());
  }
}

cudaError_t Impl::memcpy_async(
    void* dst,
    int dst_device,
    const void* src,
    int src_device,
    size_t count,
    cudaStream_t stream,
    bool p2p_enabled) {
  // All of gmlake's memory is mapped with cuMemMap: across devices without peer access only
  // cudaMemcpyPeerAsync works (see the note in PyTorch's CUDACachingAllocator.h).
  if (p2p_enabled || dst_device == src_device) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

} // namespace gmlake
