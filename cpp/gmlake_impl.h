// gmlake's allocator for PyTorch, independent of the torch minor version.
//
// `gmlake::Impl` holds everything: one Rust allocator per device (created lazily, through the
// cxx bridge of rust/gmlake-ffi), CUDA graph pool routing, history recording (TraceEntry-like
// records with the context the recorder gathered), OOM observers and trace trackers. It speaks
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

namespace gmlake {

// (first, second) as PyTorch's MempoolId_t; (0, 0) is the default pool.
using PoolId = std::pair<unsigned long long, unsigned long long>;
using ContextPtr = std::shared_ptr<c10::GatheredContext>;
using ContextRecorder = std::shared_ptr<c10::GatheredContext> (*)();

// PyTorch's TraceEntry::Action values (stable since 2.0).
enum class Action : uint8_t {
  ALLOC = 0,
  FREE_REQUESTED = 1,
  FREE_COMPLETED = 2,
  SEGMENT_ALLOC = 3,
  SEGMENT_FREE = 4,
  SEGMENT_MAP = 5,
  SEGMENT_UNMAP = 6,
  SNAPSHOT = 7,
  OOM = 8,
};

// When contexts are gathered, as PyTorch's RecordContext.
enum class When : int { NEVER = 0, STATE = 1, ALLOC = 2, ALL = 3 };

struct TraceRec {
  Action action;
  int device;
  uint64_t addr; // for OOM: the device's free bytes
  uint64_t size;
  void* stream;
  PoolId pool;
  c10::approx_time_t time;
  ContextPtr context;
  std::string compile_context;
  std::string user_metadata;
};

struct AnnotationRec {
  int device;
  c10::approx_time_t time;
  std::vector<std::pair<std::string, std::string>> metadata;
};

struct BlockRec {
  uint64_t size = 0;
  uint64_t requested_size = 0;
  bool allocated = false;
  bool active = false;
  bool stitched = false;
  ContextPtr context;
};

struct SegmentRec {
  int device = 0;
  uint64_t address = 0;
  uint64_t total_size = 0;
  uint64_t requested_size = 0;
  uint64_t allocated_size = 0;
  uint64_t active_size = 0;
  void* stream = nullptr;
  bool is_large = false;
  bool stitched = false;
  PoolId pool{0, 0};
  // Contiguous from `address`, covering the segment (PyTorch derives block addresses by
  // adding sizes).
  std::vector<BlockRec> blocks;
};

struct SnapshotData {
  std::vector<SegmentRec> segments;
  // One list per device, indexed by device.
  std::vector<std::vector<TraceRec>> traces;
  std::vector<AnnotationRec> annotations;
  // gmlake's effective configuration as key:value pairs ("backend:gmlake,...").
  std::string settings;
};

using OomObserver = std::function<void(int64_t device, size_t allocated, size_t total, size_t free)>;
using TraceTracker = std::function<void(const TraceRec&)>;
using StreamFilter = std::function<bool(cudaStream_t)>;

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
    // Pool routing and pool use counts.
    std::mutex pool_mu;
    std::atomic<int> n_routes{0};
    std::vector<std::pair<PoolId, StreamFilter>> routes;
    std::map<PoolId, int> pool_use;
    std::set<PoolId> no_split;
    std::atomic<int> n_no_split{0};
    // The core's page size (0 until the core exists).
    std::atomic<uint64_t> page_size{0};
    // empty_cache calls that found no core on this device: PyTorch's allocator synchronizes
    // every initialized device on each (num_sync_all_streams), used or not.
    std::atomic<int64_t> syncs_without_core{0};
    // Frees of record_stream'ed blocks during a capture, held until the graph proves that
    // every recorded use precedes later work of the block's stream (PyTorch's
    // graph_capture_record_stream_reuse): ptr -> (stream, free markers). Guarded by pool_mu.
    struct DeferredFree {
      cudaStream_t stream;
      std::vector<void*> markers;
    };
    std::map<uint64_t, DeferredFree> deferred;
    std::atomic<int> n_deferred{0};
    // Graph nodes known to precede the terminals of each capturing stream (by capture id).
    std::map<unsigned long long, std::map<cudaStream_t, std::unordered_set<void*>>> visited;
    // History (guarded by trace_mu; traced operations are serialised by it, so the events
    // the core records are attributed to the call that made them).
    std::mutex trace_mu;
    std::deque<TraceRec> trace;
    std::deque<AnnotationRec> annotations;
    std::unordered_map<uint64_t, ContextPtr> contexts;
    // Debug mode: set with the core when the mode is on (before `core` is published).
    std::unique_ptr<DebugDevice> debug;
  };

  DeviceState& state(int device);
  const ffi::Gmlake& core(int device);
  const ffi::Gmlake* core_if_created(int device);
  // The device whose allocator owns `ptr`, or -1.
  int owner_of(const void* ptr);
  void* malloc_on(int device, size_t nbytes, cudaStream_t stream);
  // Graph-capture reuse of record_stream'ed blocks (see DeviceState::deferred).
  bool defer_free_in_capture(DeviceState& ds, const ffi::Gmlake& c, uint64_t ptr);
  void free_safe_blocks_in_capture(DeviceState& ds, const ffi::Gmlake& c, cudaStream_t stream);
  void flush_deferred_frees(DeviceState& ds, const ffi::Gmlake& c);
  [[noreturn]] void raise_oom(int device, const ffi::AllocOutcome& r, size_t nbytes, cudaStream_t stream);
  void refresh_tracing();
  ContextPtr gather(When needed);
  // Moves the core's recorded events into the history, attaching `ctx` per `when`.
  void drain(DeviceState& ds, const ContextPtr& alloc_ctx, const ContextPtr& free_ctx);
  void push_trace(DeviceState& ds, TraceRec rec);
  void log_once(const char* key, const std::string& msg) noexcept;
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

  // History settings (guarded by hist_mu_; tracing_ mirrors "anything to record").
  std::atomic<bool> tracing_{false};
  std::mutex hist_mu_;
  bool record_history_ = false;
  ContextRecorder recorder_ = nullptr;
  size_t max_entries_ = 0;
  When when_ = When::NEVER;
  std::array<bool, 9> skip_{};
  std::vector<TraceTracker> trackers_;
  std::vector<std::string> compile_stack_;
  std::string user_metadata_;
  std::vector<OomObserver> oom_observers_;

  std::mutex log_mu_;
  std::map<std::string, int> logged_;

  // Open IPC handles: handle bytes -> the pointer handed out (as PyTorch's
  // ipcMemHandle_to_devptr). Entries whose pointer died are erased by its deleter. ipc_mu_
  // guards the map only: no driver call is made while it is held. An entry being opened
  // (`opening`) makes other openers of the same handle wait on ipc_cv_ (one opening per
  // handle, as cudaIpcOpenMemHandle wants); openers of other handles go on.
  struct IpcEntry {
    std::weak_ptr<void> ptr;
    bool opening = false;
  };
  std::mutex ipc_mu_;
  std::condition_variable ipc_cv_;
  std::map<std::string, IpcEntry> ipc_open_;
  std::shared_ptr<void> ipc_cached(const std::string& key,
                                   const std::function<std::shared_ptr<void>()>& open);
  // Called by a pointer's deleter: drops the entry of `key` unless it was opened again.
  void ipc_forget(const std::string& key);
};

} // namespace gmlake
