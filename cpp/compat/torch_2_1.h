// gmlake's adapter to the allocator interface of torch 2.1 (included by ../version_compat.h).
//
// Checked against torch/include/c10/cuda/CUDACachingAllocator.h and c10/core/Allocator.h of
// the PyPI wheel torch==2.1.2. Differences from 2.6: `int device`; Allocator::allocate is
// const and there is no copy_data; DeviceStats lives in CUDACachingAllocator (no sync / device
// alloc counters); no getMemoryFraction / enable / shareIpcHandle / recordAnnotation /
// trace trackers / pool use counts; CUDA graphs route by stream
// (beginAllocateStreamToPool(device, stream, pool) / endAllocateStreamToPool(device, stream));
// TraceEntry has no device, time or pool; snapshots have no annotations or config. No
// c10/util/ApproximateClock.h: cpp/compat/legacy supplies what gmlake_impl needs.
#pragma once

#include "compat/pool_routes.h"

namespace gmlake {

class GmlakeAllocator final : public compat::CheckpointingAllocator<int, compat::MempoolId> {
 public:
  using CheckpointingAllocator::CheckpointingAllocator;

  // CUDA graphs (2.1): allocations on `stream` go to the pool until endAllocateStreamToPool.
  void beginAllocateStreamToPool(int device, cudaStream_t stream, compat::MempoolId mempool_id) override {
    stream_routes_.begin(
        impl_, device, stream, PoolId{mempool_id.first, mempool_id.second},
        [stream](cudaStream_t s) { return s == stream; },
        "gmlake: beginAllocateStreamToPool: the stream already allocates to a pool");
  }
  void endAllocateStreamToPool(int device, cudaStream_t stream) override {
    stream_routes_.end(impl_, device, stream, "gmlake: endAllocateStreamToPool: the stream allocates to no pool");
  }

 private:
  compat::KeyedPoolRoutes<cudaStream_t> stream_routes_;
};

} // namespace gmlake
