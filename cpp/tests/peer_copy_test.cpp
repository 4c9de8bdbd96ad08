// Copies between two GPUs through torch's allocator interface with gmlake installed, with and
// without peer access: memcpyAsync(p2p_enabled=false) must work on page-mapped memory that no
// peer was granted (cudaMemcpyPeerAsync), and after enablePeerAccess both directions of
// cudaMemcpyAsync must work, on blocks mapped before the grant (access granted again) and
// after it. Blocks are several pages, some stitched (freed in a checkerboard first).
//
// usage: gmlake_peer_copy_test <path to libgmlake_torch.so>
// exit 0: passed; 77: skipped (fewer than 2 GPUs); other: failed.
#include <dlfcn.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace alloc = c10::cuda::CUDACachingAllocator;

#include "check.h"

#define CUDA_OK(call)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call,          \
                   cudaGetErrorString(e_));                                             \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

constexpr size_t MiB = size_t(1) << 20;

static std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  unsigned x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    v[i] = static_cast<unsigned char>(x >> 16);
  }
  return v;
}

// A block on `device` of `n` bytes, stitched when `stitch`: 8 MiB blocks are allocated and
// every other one freed first, so a larger request takes their pages.
static c10::DataPtr block(int device, size_t n, bool stitch, std::vector<c10::DataPtr>& keep) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  if (stitch) {
    std::vector<c10::DataPtr> tmp;
    for (int i = 0; i < 8; ++i) {
      tmp.push_back(alloc::get()->allocate(8 * MiB));
    }
    for (int i = 0; i < 8; ++i) {
      if (i % 2) {
        keep.push_back(std::move(tmp[i]));
      }
    }
  }
  return alloc::get()->allocate(n);
}

static void fill(const c10::DataPtr& p, const std::vector<unsigned char>& v, int device) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  CUDA_OK(cudaMemcpy(p.get(), v.data(), v.size(), cudaMemcpyHostToDevice));
}

static bool equal(const c10::DataPtr& p, const std::vector<unsigned char>& v, int device) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  std::vector<unsigned char> h(v.size());
  CUDA_OK(cudaMemcpy(h.data(), p.get(), v.size(), cudaMemcpyDeviceToHost));
  return std::memcmp(h.data(), v.data(), v.size()) == 0;
}

// dst on dst_dev <- src on src_dev through torch's allocator interface.
static void copy(const c10::DataPtr& dst, int dst_dev, const c10::DataPtr& src, int src_dev,
                 size_t n, bool p2p) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(src_dev));
  cudaStream_t s = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(src_dev)).stream();
  CUDA_OK(alloc::get()->memcpyAsync(dst.get(), dst_dev, src.get(), src_dev, n, s, p2p));
  CUDA_OK(cudaStreamSynchronize(s));
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <libgmlake_torch.so>\n", argv[0]);
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 2) {
    std::printf("SKIP: %d GPU(s), need 2\n", n_dev);
    return 77;
  }
  // torch_cuda registers c10's CUDA hooks (e.g. hasPrimaryContext, used by CUDAGuard), as in
  // every PyTorch process; without it c10 refuses device switches.
  if (dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::printf("note: libtorch_cuda.so not loaded (%s)\n", dlerror());
  }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) {
    std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
    return 1;
  }
  auto install = reinterpret_cast<int (*)(const char*)>(dlsym(h, "gmlake_install"));
  auto last_error = reinterpret_cast<const char* (*)()>(dlsym(h, "gmlake_last_error"));
  if (install == nullptr || install("") != 0) {
    std::fprintf(stderr, "install failed: %s\n", last_error ? last_error() : "no symbol");
    return 1;
  }
  alloc::init(n_dev);
  CHECK(alloc::get()->name() == std::string("gmlake"), "allocator is %s", alloc::get()->name().c_str());

  std::vector<c10::DataPtr> keep;
  const size_t n = 24 * MiB + 4096;  // several pages, not a page multiple
  auto src0 = block(0, n, true, keep);
  auto dst1 = block(1, n, true, keep);
  auto src1 = block(1, n, false, keep);
  auto dst0 = block(0, n, false, keep);
  const auto a = pattern(n, 1), b = pattern(n, 2);
  fill(src0, a, 0);
  fill(src1, b, 1);

  std::printf("blocks ready\n");
  // 1. No peer access anywhere: memcpyAsync(p2p_enabled=false) takes cudaMemcpyPeerAsync.
  copy(dst1, 1, src0, 0, n, false);
  CHECK(equal(dst1, a, 1), "0 -> 1 without peer access");
  copy(dst0, 0, src1, 1, n, false);
  CHECK(equal(dst0, b, 0), "1 -> 0 without peer access");

  std::printf("copies without peer access done\n");
  int can01 = 0, can10 = 0;
  CUDA_OK(cudaDeviceCanAccessPeer(&can01, 0, 1));
  CUDA_OK(cudaDeviceCanAccessPeer(&can10, 1, 0));
  if (!can01 || !can10) {
    std::printf("peer access not possible between GPU 0 and 1: p2p half skipped\n");
  } else {
    // 2. Peer access both ways (as at::cuda::get_p2p_access does): blocks mapped before the
    // grant get access again; blocks mapped after get it at once.
    alloc::get()->enablePeerAccess(0, 1);
    alloc::get()->enablePeerAccess(1, 0);
    std::printf("peer access enabled\n");
    auto late1 = block(1, n, true, keep);
    auto late0 = block(0, n, false, keep);
    fill(dst1, b, 1);
    copy(dst1, 1, src0, 0, n, true);
    CHECK(equal(dst1, a, 1), "0 -> 1 with peer access (blocks mapped before the grant)");
    copy(late0, 0, src1, 1, n, true);
    CHECK(equal(late0, b, 0), "1 -> 0 with peer access (destination mapped after)");
    copy(late1, 1, late0, 0, n, true);
    CHECK(equal(late1, b, 1), "0 -> 1 with peer access (both mapped after)");
    // A kernel-free direct peer read: device 1's copy engine reads device 0's memory.
    c10::cuda::set_device(1);
    CUDA_OK(cudaMemcpy(dst1.get(), src0.get(), n, cudaMemcpyDeviceToDevice));
    CHECK(equal(dst1, a, 1), "direct device-to-device copy issued on device 1");
  }
  std::printf("copies done, %d failure(s)\n", failures);
  keep.clear();
  src0.clear();
  dst1.clear();
  src1.clear();
  dst0.clear();
  alloc::get()->emptyCache();
  if (failures == 0) {
    std::printf("PASS peer copies (%d GPUs)\n", n_dev);
  }
  return failures == 0 ? 0 : 1;
}
