// Pool routing keyed by what the torch version names when it starts and ends routing: a
// stream (2.1: beginAllocateStreamToPool / endAllocateStreamToPool) or a CUDA graph capture
// (1.13 and 2.0: notifyCaptureBegin / notifyCaptureEnd or notifyCaptureAboutToEnd). From 2.6
// torch gives the pool and a stream filter itself (beginAllocateToPool / endAllocateToPool).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <utility>

#include "gmlake_impl.h"

namespace gmlake {
namespace compat {

// Whether `stream` is capturing the CUDA graph `graph` (allocations routed by capture id).
inline bool stream_captures(cudaStream_t stream, c10::cuda::CaptureId_t graph) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  c10::cuda::CaptureId_t id = 0;
  if (cudaStreamGetCaptureInfo(stream, &status, &id) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusActive && id == graph;
}

// (device, key) -> the pool its allocations go to, while routed.
template <class Key>
class KeyedPoolRoutes {
 public:
  // Routes the allocations of `device` that `filter` accepts to `pool` until end(device, key);
  // a key routed already is an error (`already`, the message).
  void begin(Impl& impl, int device, Key key, PoolId pool, StreamFilter filter, const char* already) {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto k = std::make_pair(device, key);
      TORCH_CHECK(routes_.find(k) == routes_.end(), already);
      routes_[k] = pool;
    }
    try {
      impl.begin_allocate_to_pool(device, pool, std::move(filter));
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      routes_.erase(std::make_pair(device, key));
      throw;
    }
  }

  // Ends the routing begun for (device, key); a key not routed is an error (`missing`).
  void end(Impl& impl, int device, Key key, const char* missing) {
    PoolId pool;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = routes_.find(std::make_pair(device, key));
      TORCH_CHECK(it != routes_.end(), missing);
      pool = it->second;
      routes_.erase(it);
    }
    impl.end_allocate_to_pool(device, pool);
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, Key>, PoolId> routes_;
};

} // namespace compat
} // namespace gmlake
