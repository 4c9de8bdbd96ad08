// gmlake::DevicePools: see pool_routing.h.
#include "pool_routing.h"

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <string>

#include "once_log.h"
#include "version_compat.h"

namespace gmlake {

namespace {

#if GMLAKE_TORCH_VERSION_NUM >= 211
// The capture a stream is in, and the graph nodes its next work will depend on.
struct CaptureState {
  bool active = false;
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* terminals = nullptr;
  size_t n = 0;
};

CaptureState capture_state(cudaStream_t s) {
  CaptureState c;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
#if CUDART_VERSION >= 13000
  cudaError_t e = cudaStreamGetCaptureInfo(s, &status, &c.id, &c.graph, &c.terminals, nullptr, &c.n);
#else
  cudaError_t e = cudaStreamGetCaptureInfo_v2(s, &status, &c.id, &c.graph, &c.terminals, &c.n);
#endif
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return CaptureState{};
  }
  c.active = status == cudaStreamCaptureStatusActive;
  return c;
}

std::vector<cudaGraphNode_t> graph_parents(cudaGraphNode_t node) {
  size_t count = 0;
#if CUDART_VERSION >= 13000
  if (cudaGraphNodeGetDependencies(node, nullptr, nullptr, &count) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  std::vector<cudaGraphNode_t> out(count);
  std::vector<cudaGraphEdgeData> edges(count);
  if (count != 0 && cudaGraphNodeGetDependencies(node, out.data(), edges.data(), &count) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
#else
  if (cudaGraphNodeGetDependencies(node, nullptr, &count) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  std::vector<cudaGraphNode_t> out(count);
  if (count != 0 && cudaGraphNodeGetDependencies(node, out.data(), &count) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
#endif
  out.resize(count);
  return out;
}
#endif

} // namespace

DevicePools::Route DevicePools::route(cudaStream_t stream) {
  Route r;
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
    if (it->second(stream)) {
      r.pool = it->first;
      r.in_pool = true;
      r.no_split = n_no_split_.load(std::memory_order_relaxed) > 0 && no_split_.count(r.pool) != 0;
      break;
    }
  }
  return r;
}

void DevicePools::begin(const ffi::Gmlake& c, PoolId pool, StreamFilter filter) {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& r : routes_) {
    TORCH_CHECK(r.first != pool, "beginAllocateToPool: already recording to mempool_id");
  }
  try {
    c.begin_capture(pool.first, pool.second);
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: beginAllocateToPool: ", e.what());
  }
  pool_use_[pool] += 1;
  routes_.emplace_back(pool, std::move(filter));
  n_routes_.store(static_cast<int>(routes_.size()), std::memory_order_release);
}

void DevicePools::end(const ffi::Gmlake& c, PoolId pool, OnceLog& log) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = std::find_if(routes_.begin(), routes_.end(), [&](const auto& r) { return r.first == pool; });
  TORCH_CHECK(it != routes_.end(), "endAllocateToPool: not currently recording to mempool_id");
  routes_.erase(it);
  n_routes_.store(static_cast<int>(routes_.size()), std::memory_order_release);
  if (routes_.empty()) {
    visited_.clear();
  }
  if (n_deferred_.load() > 0) {
    flush_deferred(c, log);
  }
  try {
    c.end_capture(pool.first, pool.second);
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake: endAllocateToPool: ", e.what());
  }
}

void DevicePools::release(const ffi::Gmlake& c, PoolId pool, OnceLog& log) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = pool_use_.find(pool);
  if (it == pool_use_.end() || it->second <= 0) {
    log("release-unknown-pool", "releasePool on a pool gmlake does not know: ignored");
    return;
  }
  if (--it->second == 0) {
    pool_use_.erase(it);
    c.release_pool(pool.first, pool.second);
  }
}

void DevicePools::incref(PoolId pool) {
  std::lock_guard<std::mutex> g(mu_);
  pool_use_[pool] += 1;
}

void DevicePools::set_no_split(PoolId pool) {
  std::lock_guard<std::mutex> g(mu_);
  no_split_.insert(pool);
  n_no_split_.store(static_cast<int>(no_split_.size()), std::memory_order_release);
}

int DevicePools::use_count(PoolId pool) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = pool_use_.find(pool);
  return it == pool_use_.end() ? 0 : it->second;
}

bool DevicePools::defer_free(const ffi::Gmlake& c, uint64_t ptr) {
#if GMLAKE_TORCH_VERSION_NUM >= 211
  rust::Vec<uint64_t> uses = c.stream_uses(ptr);
  if (uses.empty()) {
    return false;
  }
  ffi::AllocationRecord a = c.allocation(ptr);
  if (!a.found || a.ptr != ptr) {
    return false;
  }
  // The free markers: the nodes each stream that used the block has reached now. Any stream
  // not capturing (or in another graph): the free waits for events after the capture.
  const cudaStream_t own = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(a.stream));
  std::unordered_set<void*> markers;
  cudaGraph_t graph = nullptr;
  auto add = [&](cudaStream_t s) {
    CaptureState cs = capture_state(s);
    if (!cs.active || (graph != nullptr && cs.graph != graph)) {
      return false;
    }
    graph = cs.graph;
    for (size_t i = 0; i < cs.n; ++i) {
      markers.insert(static_cast<void*>(cs.terminals[i]));
    }
    return true;
  };
  if (!add(own)) {
    return false;
  }
  for (uint64_t u : uses) {
    if (!add(reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(u)))) {
      return false;
    }
  }
  std::lock_guard<std::mutex> g(mu_);
  deferred_[ptr] = DeferredFree{own, std::vector<void*>(markers.begin(), markers.end())};
  n_deferred_.store(static_cast<int>(deferred_.size()), std::memory_order_release);
  return true;
#else
  (void)c;
  (void)ptr;
  return false;
#endif
}

void DevicePools::free_safe_blocks(const ffi::Gmlake& c, cudaStream_t stream, OnceLog& log) {
#if GMLAKE_TORCH_VERSION_NUM >= 211
  CaptureState cs = capture_state(stream);
  if (!cs.active || cs.n == 0) {
    return;
  }
  std::vector<uint64_t> ready;
  {
    std::lock_guard<std::mutex> g(mu_);
    // Every node the stream's terminals depend on (kept per capture and stream: the graph
    // only grows, so nodes found before stay ancestors).
    auto& visited = visited_[cs.id][stream];
    std::vector<cudaGraphNode_t> todo(cs.terminals, cs.terminals + cs.n);
    while (!todo.empty()) {
      cudaGraphNode_t v = todo.back();
      todo.pop_back();
      if (!visited.insert(static_cast<void*>(v)).second) {
        continue;
      }
      for (cudaGraphNode_t p : graph_parents(v)) {
        todo.push_back(p);
      }
    }
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      const auto& d = it->second;
      bool ok = d.stream == stream && !d.markers.empty();
      for (size_t i = 0; ok && i < d.markers.size(); ++i) {
        ok = visited.count(d.markers[i]) != 0;
      }
      if (ok) {
        ready.push_back(it->first);
        it = deferred_.erase(it);
      } else {
        ++it;
      }
    }
    n_deferred_.store(static_cast<int>(deferred_.size()), std::memory_order_release);
  }
  // Every use is ordered before the stream's next work: free as a block of that stream only
  // (driver work, if any, in relaxed capture mode, as every allocator call during a capture).
  c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  for (uint64_t p : ready) {
    ffi::FreeOutcome r = c.clear_stream_uses(p);
    if (r.status == ffi::FreeStatus::Done) {
      r = c.free_ptr(p);
    }
    if (r.status != ffi::FreeStatus::Done) {
      log("capture-reuse", "gmlake: freeing a block held during capture failed: " + std::string(r.message));
    }
  }
#else
  (void)c;
  (void)stream;
  (void)log;
#endif
}

void DevicePools::flush_deferred(const ffi::Gmlake& c, OnceLog& log) {
  // Caller holds mu_. The blocks still held are freed with their stream uses: the core waits
  // for events on those streams, recorded once no capture is underway.
  std::optional<c10::cuda::CUDAStreamCaptureModeGuard> relaxed;
  relaxed.emplace(cudaStreamCaptureModeRelaxed);
  for (const auto& kv : deferred_) {
    ffi::FreeOutcome r = c.free_ptr(kv.first);
    if (r.status != ffi::FreeStatus::Done) {
      log("capture-reuse", "gmlake: freeing a block held during capture failed: " + std::string(r.message));
    }
  }
  deferred_.clear();
  n_deferred_.store(0, std::memory_order_release);
}

} // namespace gmlake
