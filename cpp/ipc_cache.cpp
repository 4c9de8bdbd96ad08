// gmlake::IpcCache: see ipc_cache.h.
#include "ipc_cache.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstring>

#include "gmlake_types.h"
#include "once_log.h"

namespace gmlake {

std::shared_ptr<void> IpcCache::cached(
    const std::string& key,
    const std::function<std::shared_ptr<void>()>& open) {
  // Declared before the lock, so destroyed after it is released on every way out: the
  // pointer's deleter takes mu_ (forget), and must never run while it is held.
  std::shared_ptr<void> sp;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    auto it = open_.find(key);
    if (it == open_.end()) {
      break;
    }
    if (it->second.opening) {
      cv_.wait(lk);  // another thread opens this handle (without the lock)
      continue;
    }
    sp = it->second.ptr.lock();
    if (sp) {
      return sp;
    }
    break;  // its last pointer died; the deleter's forget keeps an entry being opened
  }
  open_[key].opening = true;  // if this throws, nothing is opened yet
  lk.unlock();
  // The driver import (descriptors duplicated, pages imported and mapped, or
  // cudaIpcOpenMemHandle) runs without mu_: deleters and openers of other handles go on.
  try {
    sp = open();
  } catch (...) {
    lk.lock();
    open_.erase(key);
    cv_.notify_all();
    throw;
  }
  lk.lock();
  auto it = open_.find(key);  // our entry: nobody erases an entry being opened
  if (it != open_.end()) {
    it->second.ptr = sp;
    it->second.opening = false;
  }
  cv_.notify_all();
  return sp;
}

void IpcCache::forget(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = open_.find(key);
  // A new opening of the same handle may have replaced the entry meanwhile, or be under
  // way: keep that one.
  if (it != open_.end() && !it->second.opening && it->second.ptr.expired()) {
    open_.erase(it);
  }
}

std::shared_ptr<void> IpcCache::open_cuda(const std::string& raw, OnceLog& log) {
  TORCH_CHECK(
      raw.size() == sizeof(cudaIpcMemHandle_t),
      "gmlake: getIpcDevPtr: a cudaMalloc IPC handle has ", sizeof(cudaIpcMemHandle_t),
      " bytes, got ", raw.size());
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  const std::string key = std::string("c") + raw;
  return cached(key, [&]() -> std::shared_ptr<void> {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, raw.data(), sizeof h);
    void* p = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    return std::shared_ptr<void>(p, [this, device, key, &log](void* q) {
      forget(key);
      c10::cuda::CUDAGuard guard(device);
      cudaError_t err = cudaIpcCloseMemHandle(q);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        log("cudaIpcCloseMemHandle", std::string("gmlake: cudaIpcCloseMemHandle failed: ") +
                cudaGetErrorString(err));
      }
    });
  });
}

} // namespace gmlake
