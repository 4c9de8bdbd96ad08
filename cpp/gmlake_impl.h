// gmlake's allocator for PyTorch, independent of the torch minor version.
//
// `gmlake::Impl` holds one Rust allocator per device (created lazily, through the cxx bridge of
// rust/gmlake-ffi) and delegates to its units: CUDA graph pool routing (pool_routing.h),
// history recording with OOM observers and trace trackers (history.h: TraceEntry-like records
// with the context the recorder gathered), open CUDA IPC handles (ipc_cache.h). It speaks
// in types that have not changed across torch 2.x (DataPtr, cudaStream_t, GatheredContext,
// c10::Error). The subclass of CUDAAllocator that torch calls is in version_compat.h: a thin
// adapter from each torch version's interface to this class.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/ApproximateClock.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "rust/cxx.h"
#include "gmlake-ffi/src/lib.rs.h"
#include "gmlake_debug.h"
#include "gmlake_types.h"
#include "history.h"
#include "ipc_cache.h"
#include "once_log.h"
#include "pool_routing.h"

namespace gmlake {

// The deleter of every DataPtr gmlake hands out (raw_deleter()).
void local_raw_delete(void* ptr);

// Called when an allocation of `bytes` on `device` ran out of memory, before the error is
// raised: the host tier (tier.cpp) evicts put tensors and waits for their copies; true when
// memory was freed (the allocation is then tried once more). nullptr: none registered.
using TierRelief = bool (*)(int device, uint64_t bytes);
void set_tier_relief(TierRelief relief);

class Impl {
 public:
  static constexpr int kMaxDevices = 128;

  // `conf`: key:value pairs over the environment's configuration (checked by the caller).
  explicit Impl(std::string conf);
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // The process's instance (set by the constructor; never destroyed).
  static Impl* instance();

  const std::string& conf() const {
    return conf_;
  }

  // The allocator of `device`, created if needed (the host tier, tier.cpp, builds on it).
  const ffi::Gmlake& core_of(int device) {
    return core(device);
  }

  // Lifecycle.
  void init(int device_count);
  bool initialized() const {
    return device_count_.load(std::memory_order_acquire) > 0;
  }
  int device_count() const {
    return device_count_.load(std::memory_order_acquire);
  }

  // Allocation. Throw c10::OutOfMemoryError on OOM, c10::Error on other errors.
  c10::DataPtr allocate(size_t nbytes);
  void* raw_alloc(size_t nbytes);
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream);
  // Never throws: errors are logged (it runs as a deleter).
  void free(void* ptr) noexcept;
  void record_stream(void* ptr, c10::DeleterFnPtr deleter, int device, cudaStream_t stream);
  void* base_allocation(void* ptr, size_t* size);
  void copy_data(void* dest, const void* src, size_t count) const;

  // Caching.
  void empty_cache(PoolId pool);
  void cache_info(int device, size_t* largest_block);
  void set_memory_fraction(double fraction, int device);
  double memory_fraction(int device);
  void enable(bool value) {
    enabled_.store(value, std::memory_order_release);
  }
  bool is_enabled() const {
    return enabled_.load(std::memory_order_acquire);
  }

  // Statistics. `present` is false for a device whose allocator was never created.
  ffi::Stats stats(int device, bool* present);
  void reset_accumulated_stats(int device);
  void reset_peak_stats(int device);
  std::string stats_json(int device);
  std::string snapshot_json(int device);
  SnapshotData snapshot(PoolId pool, bool include_traces);
  std::string settings_string();

  // CUDA graph pools.
  void begin_allocate_to_pool(int device, PoolId pool, StreamFilter filter);
  void end_allocate_to_pool(int device, PoolId pool);
  void release_pool(int device, PoolId pool) noexcept;
  void create_or_incref_pool(int device, PoolId pool);
  // MemPool(no_split=True): every allocation of the pool gets whole pages of its own (no two
  // allocations share a page), as PyTorch's pool gives each its own segment.
  void set_no_split(int device, PoolId pool);
  int pool_use_count(int device, PoolId pool);
  bool check_pool_live_allocations(
      int device,
      PoolId pool,
      const std::vector<void*>& expected_live);
  struct PoolBlock {
    uint64_t address;
    uint64_t size;
    uint64_t requested;
    uint64_t stream;
  };
  // Allocated blocks of a graph pool, in address order.
  std::vector<PoolBlock> live_blocks_in_pool(int device, PoolId pool);
  // Brings a pool back to a checkpoint taken with live_blocks_in_pool (CUDA graph trees):
  // blocks allocated since are freed (returned); checkpointed blocks freed since are
  // allocated again at their addresses. Throws a c10::Error if that is impossible (the range
  // was reused differently).
  std::vector<void*> restore_pool_checkpoint(
      int device,
      PoolId pool,
      const std::vector<PoolBlock>& checkpoint);

  // History.
  void record_history(
      bool enabled,
      ContextRecorder recorder,
      size_t max_entries,
      When when,
      bool clear,
      const std::vector<Action>& skip);
  bool history_enabled();
  void record_annotation(std::vector<std::pair<std::string, std::string>> md);
  void push_compile_context(std::string ctx);
  void pop_compile_context();
  void set_user_metadata(std::string md);
  std::string user_metadata();
  void attach_oom_observer(OomObserver obs);
  void attach_trace_tracker(TraceTracker tracker);

  // CUDA IPC. share_ipc: the handle bytes (PyTorch's layout, version 2, type 'e') of the
  // allocation containing `ptr` and the offset of `ptr` in the range the receiver maps.
  // get_ipc_dev_ptr: opens a handle of another process on the current device (gmlake's or
  // the native allocator's: 'e' page handles are mapped by gmlake, 'c' cudaMalloc handles are
  // opened with cudaIpcOpenMemHandle); the same handle opened twice gives the same pointer
  // while the first is alive; the range is closed when the last shared_ptr goes.
  // open_cuda_ipc_handle: a raw cudaIpcMemHandle_t (torch < 2.5's handle bytes).
  std::pair<int64_t, std::string> share_ipc(void* ptr);
  std::shared_ptr<void> get_ipc_dev_ptr(const std::string& handle);
  std::shared_ptr<void> open_cuda_ipc_handle(const std::string& raw);

  // Memory debugging mode (GMLAKE_CONF=debug:...; see gmlake_debug.h). debug_check checks
  // the canaries of freed blocks (waiting for their copies if `wait`) and returns the number
  // of reports so far; debug_reports_json: every report as a JSON list.
  size_t debug_check(bool wait);
  std::string debug_reports_json();
  // The mode's bits on the first created device (0: off or no device yet).
  uint32_t debug_mode();

  // Peers and copies.
  void enable_peer_access(int dev, int dev_to_access);
  cudaError_t memcpy_async(
      void* dst,
      int dst_device,
      const void* src,
      int src_device,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled);

 private:
  struct DeviceState {
    int index = 0;
    std::atomic<ffi::Gmlake*> core{nullptr};
    // CUDA graph pools: routing, use counts, frees held during a capture (pool_routing.h).
    DevicePools pools;
    // The core's page size (0 until the core exists).
    std::atomic<uint64_t> page_size{0};
    // empty_cache calls that found no core on this device: PyTorch's allocator synchronizes
    // every initialized device on each (num_sync_all_streams), used or not.
    std::atomic<int64_t> syncs_without_core{0};
    // History (history.h; traced operations are serialised by hist.mu, so the events the core
    // records are attributed to the call that made them).
    DeviceHistory hist;
    // Debug mode: set with the core when the mode is on (before `core` is published).
    std::unique_ptr<DebugDevice> debug;
  };

  DeviceState& state(int device);
  const ffi::Gmlake& core(int device);
  const ffi::Gmlake* core_if_created(int device);
  // The device whose allocator owns `ptr`, or -1.
  int owner_of(const void* ptr);
  void* malloc_on(int device, size_t nbytes, cudaStream_t stream);
  [[noreturn]] void raise_oom(int device, const ffi::AllocOutcome& r, size_t nbytes, cudaStream_t stream);
  void refresh_tracing();
  // Moves the core's recorded events into the history, attaching the contexts per the
  // settings (caller holds ds.hist.mu).
  void drain(DeviceState& ds, const ContextPtr& alloc_ctx, const ContextPtr& free_ctx);
  void log_once(const char* key, const std::string& msg) noexcept {
    log_(key, msg);
  }
  // Debug mode: checks completed canary copies of a device and files their reports.
  void debug_poll(DeviceState& ds, bool wait) noexcept;

  std::mutex debug_mu_;
  std::vector<DebugReport> debug_reports_;

  const std::string conf_;
  std::atomic<int> device_count_{0};
  std::array<std::unique_ptr<DeviceState>, kMaxDevices> devices_;
  std::mutex create_mu_;
  std::atomic<int> created_{0};
  std::atomic<bool> enabled_{true};

  History history_;
  OnceLog log_;
  IpcCache ipc_;
};

} // namespace gmlake
