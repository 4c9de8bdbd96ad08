// The records gmlake::Impl (gmlake_impl.h) and its units (history.h, pool_routing.h,
// ipc_cache.h) speak in, independent of the torch version.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/ApproximateClock.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rust/cxx.h"
#include "gmlake-ffi/src/lib.rs.h"

namespace gmlake {

// (first, second) as PyTorch's MempoolId_t; (0, 0) is the default pool.
using PoolId = std::pair<unsigned long long, unsigned long long>;
using ContextPtr = std::shared_ptr<c10::GatheredContext>;
using ContextRecorder = std::shared_ptr<c10::GatheredContext> (*)();

// PyTorch's TraceEntry::Action values (stable since 2.0), as the bridge defines them.
using Action = ffi::TraceAction;

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

} // namespace gmlake
