// Do VMM calls made from several host threads at once run in parallel in the driver? A stitch
// maps one handle per call (cuMemMap takes no batch), so a miss that moves hundreds of pages
// costs hundreds of serial calls; if the driver lets threads map disjoint ranges at the same
// time, a pool of threads would divide that time.
// Build and run on the GPU machine: nvcc -O2 -o probe bench/vmm_threads_probe.cu -lcuda -lpthread && ./probe
// For T = 1, 2, 4, 8 threads, K = 256 pages created once: each thread maps its slice of the
// range (one cuMemMap per page), then one cuMemSetAccess over the whole range (main thread) or
// one per slice (each thread); then each thread unmaps its slice. Wall time of each phase,
// on an idle GPU and right after a 300 ms kernel was launched on another stream ("busy").
// Median of 5 rounds; per page in microseconds, and the speed-up over one thread.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); \
  printf("FAIL %s: %s (line %d)\n", #x, s, __LINE__); return 1; } } while (0)
__global__ void spin(long long cycles) { long long t0 = clock64(); while (clock64() - t0 < cycles) {} }
static double now_us() { using namespace std::chrono; return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count(); }
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

// Runs f(t) on threads 0..T-1 (thread 0 is the caller), started together; returns the wall
// time from the start signal until every thread is done, and whether all succeeded.
template <class F> static double parallel(int T, F f, bool& ok) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<bool> good{true};
  std::vector<std::thread> th;
  for (int t = 1; t < T; t++)
    th.emplace_back([&, t] { ready++; while (!go.load()) {} if (!f(t)) good = false; });
  while (ready.load() < T - 1) {}
  double t0 = now_us();
  go = true;
  if (!f(0)) good = false;
  for (auto& x : th) x.join();
  ok = good.load();
  return now_us() - t0;
}

int main() {
  CK(cuInit(0));
  cudaFree(0);  // the runtime's primary context, current on this thread
  CUcontext ctx; CK(cuCtxGetCurrent(&ctx));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  size_t G; CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int clk_khz; cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0);
  const long long spin_cycles = (long long)clk_khz * 300;
  const int K = 256;
  std::vector<CUmemGenericAllocationHandle> h(K);
  for (auto& x : h) CK(cuMemCreate(&x, G, &prop, 0));
  CUdeviceptr va; CK(cuMemAddressReserve(&va, K * G, 0, 0, 0));
  printf("page %zu KiB, %d pages\n", G >> 10, K);
  printf("%-5s %-14s %2s | %9s %9s %9s | per page: %7s %7s %7s | speed-up map, unmap\n", "gpu", "access", "T", "map us", "access", "unmap", "map", "access", "unmap");
  double base_map[2][2] = {}, base_unmap[2][2] = {};
  for (int busy = 0; busy < 2; busy++) {
    for (int per_slice = 0; per_slice < 2; per_slice++) {
      for (int T : {1, 2, 4, 8}) {
        std::vector<double> tm, ta, tu;
        for (int rep = 0; rep < 5; rep++) {
          if (busy) spin<<<1, 1, 0, s>>>(spin_cycles);
          bool ok1, ok2, ok3 = true;
          auto slice = [&](int t, int& lo, int& hi) { lo = K * t / T; hi = K * (t + 1) / T; };
          double m = parallel(T, [&](int t) {
            if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return false;
            int lo, hi; slice(t, lo, hi);
            for (int i = lo; i < hi; i++)
              if (cuMemMap(va + i * G, G, 0, h[i], 0) != CUDA_SUCCESS) return false;
            if (per_slice && cuMemSetAccess(va + lo * G, (hi - lo) * G, &acc, 1) != CUDA_SUCCESS) return false;
            return true;
          }, ok1);
          double a = 0;
          if (!per_slice) { double t0 = now_us(); ok3 = cuMemSetAccess(va, K * G, &acc, 1) == CUDA_SUCCESS; a = now_us() - t0; }
          double u = parallel(T, [&](int t) {
            if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return false;
            int lo, hi; slice(t, lo, hi);
            for (int i = lo; i < hi; i++)
              if (cuMemUnmap(va + i * G, G) != CUDA_SUCCESS) return false;
            return true;
          }, ok2);
          if (!ok1 || !ok2 || !ok3) { printf("FAIL: a call failed (T=%d busy=%d per_slice=%d)\n", T, busy, per_slice); return 1; }
          cudaStreamSynchronize(s);
          tm.push_back(m); ta.push_back(a); tu.push_back(u);
        }
        double M = med(tm), A = med(ta), U = med(tu);
        if (T == 1) { base_map[busy][per_slice] = M + A; base_unmap[busy][per_slice] = U; }
        printf("%-5s %-14s %2d | %9.0f %9.0f %9.0f | per page: %7.2f %7.2f %7.2f | %.2fx %.2fx\n",
               busy ? "busy" : "idle", per_slice ? "per slice" : "once, after", T, M, A, U,
               M / K, A / K, U / K, base_map[busy][per_slice] / (M + A), base_unmap[busy][per_slice] / U);
      }
    }
  }
  CK(cuMemAddressFree(va, K * G));
  for (auto x : h) CK(cuMemRelease(x));
  printf("done\n");
  return 0;
}
