// Loads the patched libc10_cuda (no GPU needed), reports which CUDA allocator is in use and
// calls into it as far as a machine without a GPU allows: init(1), the statistics of device 0,
// emptyCache, then one allocation, which must fail with a c10::Error (no driver / no device)
// rather than crash. Used by scripts/build-patched-c10.sh.
//
//   probe [SETTINGS]   2.x: SETTINGS goes to setAllocatorSettings, PyTorch's run-time parse of
//                      PYTORCH_CUDA_ALLOC_CONF, which checks that a "backend:" value names the
//                      allocator chosen at load time. Exit status: 0 ok, 3 settings refused,
//                      4 an unexpected result.
// Built with -DGMLAKE_PROBE_TORCH1 for torch 1.13 (free functions, no allocator class).
#include <c10/cuda/CUDACachingAllocator.h>
#if !defined(GMLAKE_PROBE_TORCH1) && __has_include(<c10/cuda/CUDAAllocatorConfig.h>)
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif

#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

extern "C" const char* gmlake_c10_backend(void);

namespace cca = c10::cuda::CUDACachingAllocator;

int main(int argc, char** argv) {
  std::printf("backend=%s", gmlake_c10_backend());
#ifndef GMLAKE_PROBE_TORCH1
  cca::CUDAAllocator* a = cca::get();
  std::printf(" name()=%s initialized=%d", a->name().c_str(), a->initialized() ? 1 : 0);
  if (argc > 1) {
    try {
      cca::setAllocatorSettings(argv[1]);
      std::printf(" setAllocatorSettings(\"%s\")=accepted", argv[1]);
    } catch (const c10::Error& e) {
      std::printf(" setAllocatorSettings(\"%s\")=refused: %s\n", argv[1], e.what_without_backtrace());
      return 3;
    }
  }
#else
  (void)argc;
  (void)argv;
#endif
  // Calls into the allocator that need no device.
  cca::init(1);
  const auto stats = cca::getDeviceStats(0);
  cca::emptyCache();
  std::printf(" init(1)+getDeviceStats(0): allocated=%lld max_split_size=%s emptyCache()=ok",
      static_cast<long long>(stats.allocated_bytes[0].current),
      stats.max_split_size == std::numeric_limits<int64_t>::max() ? "max" : std::to_string(stats.max_split_size).c_str());
  // An allocation needs a device: it must raise, not crash.
  try {
    void* p = cca::raw_alloc(1 << 20);
    std::printf(" raw_alloc(1 MiB)=%p (a GPU?)\n", p);
    cca::raw_delete(p);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    msg = msg.substr(0, msg.find('\n'));
    std::printf(" raw_alloc(1 MiB) raised c10::Error: %s\n", msg.c_str());
  }
  return 0;
}
