// One device's CUDA graph pools for gmlake::Impl (gmlake_impl.h): which pool an allocation goes
// to (routings begun by beginAllocateToPool, a stack: the innermost whose stream filter
// accepts the stream wins), pool use counts, pools without splitting (MemPool(no_split=True)),
// and the frees of record_stream'ed blocks held during a capture until the graph orders every
// recorded use before later work of the block's stream (PyTorch's
// graph_capture_record_stream_reuse; torch 2.11).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gmlake_types.h"

namespace gmlake {

class OnceLog;

class DevicePools {
 public:
  struct Route {
    bool in_pool = false;
    PoolId pool{0, 0};
    bool no_split = false;
  };

  // Whether any routing is underway (a graph may be capturing).
  bool routing() const {
    return n_routes_.load(std::memory_order_acquire) > 0;
  }
  // The pool an allocation on `stream` goes to (call only while routing()).
  Route route(cudaStream_t stream);

  // beginAllocateToPool / endAllocateToPool: `c` is told of the capture.
  void begin(const ffi::Gmlake& c, PoolId pool, StreamFilter filter);
  void end(const ffi::Gmlake& c, PoolId pool, OnceLog& log);
  // Drops a use of `pool`; the core releases it with the last.
  void release(const ffi::Gmlake& c, PoolId pool, OnceLog& log);
  void incref(PoolId pool);
  void set_no_split(PoolId pool);
  int use_count(PoolId pool);

  // Graph-capture reuse of record_stream'ed blocks (torch 2.11; elsewhere nothing is held).
  bool has_deferred() const {
    return n_deferred_.load(std::memory_order_acquire) > 0;
  }
  // Holds the free of `ptr` if another stream used it during the capture: true when held.
  bool defer_free(const ffi::Gmlake& c, uint64_t ptr);
  // Frees the held blocks of `stream` whose uses the graph now orders before its next work.
  void free_safe_blocks(const ffi::Gmlake& c, cudaStream_t stream, OnceLog& log);

 private:
  // Caller holds mu_.
  void flush_deferred(const ffi::Gmlake& c, OnceLog& log);

  std::mutex mu_;
  std::atomic<int> n_routes_{0};
  std::vector<std::pair<PoolId, StreamFilter>> routes_;
  std::map<PoolId, int> pool_use_;
  std::set<PoolId> no_split_;
  std::atomic<int> n_no_split_{0};
  // Held frees: ptr -> (stream, free markers: the graph nodes each using stream had reached).
  struct DeferredFree {
    cudaStream_t stream;
    std::vector<void*> markers;
  };
  std::map<uint64_t, DeferredFree> deferred_;
  std::atomic<int> n_deferred_{0};
  // Graph nodes known to precede the terminals of each capturing stream (by capture id).
  std::map<unsigned long long, std::map<cudaStream_t, std::unordered_set<void*>>> visited_;
};

} // namespace gmlake
