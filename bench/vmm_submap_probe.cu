// What do larger physical handles save, and can one map pieces of a handle? (issue 12)
// Build and run on the GPU machine: nvcc -O2 -o probe bench/vmm_submap_probe.cu -lcuda && ./probe
// Every case maps 64 MiB as handles of one size, sets access once over it, unmaps it in one call
// and releases; each runs on an idle GPU and again while a 200 ms kernel spins on another stream.
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <vector>

#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); \
  printf("FAIL %s: %s (line %d)\n", #x, s, __LINE__); return 1; } } while (0)

__global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}

static double now_us() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

static CUmemAllocationProp prop;
static CUmemAccessDesc acc;
static size_t gran;
static cudaStream_t s;
static long long spin_cycles;

// 64 MiB as handles of `pages` pages each, each handle mapped whole (the driver refuses a
// non-zero offset into a handle: "operation not supported", so a handle is the unit of mapping).
static int run_case(int pages, bool busy) {
  const int n = 32;
  const size_t sz = gran;
  CUdeviceptr va; CK(cuMemAddressReserve(&va, sz * n, 0, 0, 0));
  int handles = n / pages;
  size_t hsz = sz * pages;
  std::vector<CUmemGenericAllocationHandle> hs(handles);
  if (busy) spin<<<1, 1, 0, s>>>(spin_cycles);
  double t0 = now_us();
  for (int i = 0; i < handles; i++) CK(cuMemCreate(&hs[i], hsz, &prop, 0));
  double t1 = now_us();
  for (int i = 0; i < handles; i++) CK(cuMemMap(va + i * hsz, hsz, 0, hs[i], 0));
  double t2 = now_us();
  CK(cuMemSetAccess(va, hsz * handles, &acc, 1));
  double t3 = now_us();
  CK(cuMemUnmap(va, hsz * handles));
  double t4 = now_us();
  for (auto h : hs) CK(cuMemRelease(h));
  double t5 = now_us();
  cudaStreamSynchronize(s);
  CK(cuMemAddressFree(va, sz * n));
  printf("%4d MiB handles x %2d  %4s %8.0f %8.0f %8.0f %8.0f %8.0f %8.0f\n", (int)(hsz >> 20), handles,
         busy ? "busy" : "idle", t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0);
  return 0;
}

int main() {
  cudaFree(0);
  int clk_khz; cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0);
  spin_cycles = (long long)clk_khz * 200;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  acc = {};
  acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  printf("granularity %zu; 32 pages (64 MiB) per case; microseconds\n", gran);
  printf("%-22s %4s %8s %8s %8s %8s %8s %8s\n", "case", "gpu", "create", "map", "setacc", "unmap", "release", "total");
  {  // a non-zero offset into a handle
    CUdeviceptr va; CK(cuMemAddressReserve(&va, gran * 4, 0, 0, 0));
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, gran * 4, &prop, 0));
    CUresult r = cuMemMap(va, gran, gran, h, 0);
    const char* e; cuGetErrorString(r, &e);
    printf("cuMemMap of one page at offset 1 page into a 4-page handle: %s\n", r == CUDA_SUCCESS ? "ok" : e);
    if (r == CUDA_SUCCESS) CK(cuMemUnmap(va, gran));
    CK(cuMemMap(va, gran * 4, 0, h, 0));
    r = cuMemUnmap(va + gran, gran);
    cuGetErrorString(r, &e);
    printf("cuMemUnmap of one page inside a 4-page mapping: %s\n", r == CUDA_SUCCESS ? "ok" : e);
    if (r != CUDA_SUCCESS) CK(cuMemUnmap(va, gran * 4));
    CK(cuMemRelease(h)); CK(cuMemAddressFree(va, gran * 4));
  }
  for (int rep = 0; rep < 3; rep++)
    for (int busy = 0; busy < 2; busy++)
      for (int pages : {1, 2, 4, 8, 10, 16, 32})
        if (run_case(pages, busy)) return 1;
  // A 64 MiB handle mapped a second time elsewhere (an alias), access set there; released while
  // mapped: its memory stays until the last mapping goes.
  {
    const size_t sz = gran * 32;
    CUdeviceptr va, vb; CK(cuMemAddressReserve(&va, sz, 0, 0, 0)); CK(cuMemAddressReserve(&vb, sz, 0, 0, 0));
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, sz, &prop, 0));
    CK(cuMemMap(va, sz, 0, h, 0)); CK(cuMemSetAccess(va, sz, &acc, 1));
    double t = now_us(); CK(cuMemMap(vb, sz, 0, h, 0));
    double t2 = now_us(); CK(cuMemSetAccess(vb, sz, &acc, 1));
    printf("alias of a 64 MiB handle: map %.0f us, set access %.0f us\n", t2 - t, now_us() - t2);
    size_t f0, tot; cuMemGetInfo(&f0, &tot);
    CK(cuMemRelease(h)); CK(cuMemUnmap(va, sz));
    size_t f1; cuMemGetInfo(&f1, &tot);
    CK(cuMemUnmap(vb, sz));
    size_t f2; cuMemGetInfo(&f2, &tot);
    printf("released while mapped: free memory +%zu MiB after one mapping went, +%zu MiB after the last\n",
           (f1 - f0) >> 20, (f2 - f0) >> 20);
    CK(cuMemAddressFree(va, sz)); CK(cuMemAddressFree(vb, sz));
  }
  printf("done\n");
  return 0;
}
