// Loads the patched libc10_cuda (no GPU needed) and reports which CUDA allocator is in use;
// with an argument, passes it to setAllocatorSettings, PyTorch's run-time parse of
// PYTORCH_CUDA_ALLOC_CONF (torch.cuda.memory._set_allocator_settings), which checks that a
// "backend:" value is the allocator chosen at load time. Used by scripts/build-patched-c10.sh
// for torch 2.x. Exit status: 0 ok, 3 the settings were refused.
#include <c10/cuda/CUDACachingAllocator.h>
#if __has_include(<c10/cuda/CUDAAllocatorConfig.h>)
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  namespace cca = c10::cuda::CUDACachingAllocator;
  cca::CUDAAllocator* a = cca::get();
  std::printf("backend=%s initialized=%d\n", a->name().c_str(), a->initialized() ? 1 : 0);
  if (argc > 1) {
    try {
      cca::setAllocatorSettings(argv[1]);
      std::printf("setAllocatorSettings(\"%s\"): accepted\n", argv[1]);
    } catch (const c10::Error& e) {
      std::printf("setAllocatorSettings(\"%s\"): refused: %s\n", argv[1], e.what_without_backtrace());
      return 3;
    }
  }
  return 0;
}
