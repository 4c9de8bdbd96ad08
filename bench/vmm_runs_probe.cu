// What a VMM call costs per page when pages are mapped in runs, as the allocator maps them,
// and whether mapping a page that is already mapped elsewhere (a stitched page, whose old
// range keeps it as an alias) costs more or less than its first mapping. The replay's cost
// model (rust/gmlake-cli/src/cost.rs) takes its figures from this probe.
// Build and run on the GPU machine: nvcc -O2 -o probe bench/vmm_runs_probe.cu -lcuda && ./probe
// Part 1: for runs of k pages: create k, map k + one access call over the run, unmap k,
// release k; on an idle GPU, right after a 100 ms kernel was launched on another stream
// ("busy"), and behind 2,000 short queued kernels ("queue"). Median of 7 rounds.
// Part 2: 64 pages mapped for the first time against 64 aliases of pages mapped at a home
// range; access once per run or once per page; unmap per page or once per run.
// Part 3: do VMM calls slow kernels down? A memory-bound kernel streams over a 1 GiB buffer,
// 400 launches back to back, timed with events, while the host waits, maps + grants + unmaps
// runs of 8 fresh pages over and over, only maps + grants, or only unmaps; also gives the
// calls' host cost while the GPU is executing without pause.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); \
  printf("FAIL %s: %s (line %d)\n", #x, s, __LINE__); return 1; } } while (0)
__global__ void spin(long long cycles) { long long t0 = clock64(); while (clock64() - t0 < cycles) {} }
__global__ void touch(char* p) { p[threadIdx.x] += 1; }
static double now_us() { using namespace std::chrono; return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count(); }
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

__global__ void stream_kernel(float4* p, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (; i < n; i += stride) { float4 v = p[i]; v.x += 1.f; p[i] = v; }
}

// What every part needs: device memory properties, the page size, read-write access, and a
// non-blocking stream for the kernels.
struct Setup {
  CUmemAllocationProp prop = {};
  CUmemAccessDesc acc = {};
  size_t G = 0;
  cudaStream_t s = nullptr;
};
static int setup(Setup& u) {
  u.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; u.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; u.prop.location.id = 0;
  CK(cuMemGetAllocationGranularity(&u.G, &u.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  u.acc.location = u.prop.location; u.acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  cudaStreamCreateWithFlags(&u.s, cudaStreamNonBlocking);
  return 0;
}
// Clock cycles of a spin kernel of about `ms` milliseconds.
static long long spin_cycles_for(int ms) {
  int clk_khz; cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0);
  return (long long)clk_khz * ms;
}
#define SETUP Setup u; if (setup(u)) return 1; auto& prop = u.prop; auto& acc = u.acc; size_t G = u.G; cudaStream_t s = u.s;

static int runs_part() {
  SETUP
  long long spin_cycles = spin_cycles_for(100);
  char* scratch; cudaMalloc(&scratch, 1 << 20);
  CUdeviceptr va; CK(cuMemAddressReserve(&va, 64 * G, 0, 0, 0));
  printf("%-5s %4s | %10s %10s %10s %10s | per page: %8s %8s %8s %8s\n", "gpu", "k", "create", "map+acc", "unmap", "release", "create", "map+acc", "unmap", "release");
  for (int mode = 0; mode < 3; mode++) {  // 0 idle, 1 busy (spin kernel), 2 busy with a stream of short kernels queued
    for (int k : {1, 2, 8, 32}) {
      std::vector<double> tc, tm, tu, tr;
      for (int rep = 0; rep < 7; rep++) {
        if (mode == 1) spin<<<1, 1, 0, s>>>(spin_cycles);
        if (mode == 2) { for (int i = 0; i < 2000; i++) touch<<<1, 32, 0, s>>>(scratch); }
        std::vector<CUmemGenericAllocationHandle> h(k);
        double t0 = now_us();
        for (auto& x : h) CK(cuMemCreate(&x, G, &prop, 0));
        double t1 = now_us();
        for (int i = 0; i < k; i++) CK(cuMemMap(va + i * G, G, 0, h[i], 0));
        CK(cuMemSetAccess(va, k * G, &acc, 1));
        double t2 = now_us();
        for (int i = 0; i < k; i++) CK(cuMemUnmap(va + i * G, G));
        double t3 = now_us();
        for (auto x : h) CK(cuMemRelease(x));
        double t4 = now_us();
        cudaStreamSynchronize(s);
        tc.push_back(t1 - t0); tm.push_back(t2 - t1); tu.push_back(t3 - t2); tr.push_back(t4 - t3);
      }
      const char* names[] = {"idle", "busy", "queue"};
      printf("%-5s %4d | %10.1f %10.1f %10.1f %10.1f | per page: %8.1f %8.1f %8.1f %8.1f\n", names[mode], k,
             med(tc), med(tm), med(tu), med(tr), med(tc) / k, med(tm) / k, med(tu) / k, med(tr) / k);
    }
  }
  return 0;
}

static int alias_part() {
  SETUP
  long long spin_cycles = spin_cycles_for(300);
  const int N = 64;
  CUdeviceptr home, fresh_va, alias_va;
  CK(cuMemAddressReserve(&home, N * G, 0, 0, 0)); CK(cuMemAddressReserve(&fresh_va, N * G, 0, 0, 0)); CK(cuMemAddressReserve(&alias_va, N * G, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> hh(N), fh(N);
  for (auto& h : hh) CK(cuMemCreate(&h, G, &prop, 0));
  for (auto& h : fh) CK(cuMemCreate(&h, G, &prop, 0));
  for (int i = 0; i < N; i++) CK(cuMemMap(home + i * G, G, 0, hh[i], 0));
  CK(cuMemSetAccess(home, N * G, &acc, 1));
  printf("granularity %zu, %d pages per case, median of 5 rounds, us per page\n", G, N);
  printf("%-6s %-34s %8s %8s %8s %8s\n", "gpu", "case", "map", "access", "unmap", "total");
  for (int busy = 0; busy < 2; busy++) {
    for (int c = 0; c < 4; c++) {
      // c0: fresh pages (first mapping), one access call over the run, one unmap call per page
      // c1: aliases of pages mapped at home, one access call over the run, unmap per page
      // c2: aliases, access per page
      // c3: aliases, one access call, one unmap call over the whole run
      const char* names[] = {"first mapping, 1 access/run", "alias, 1 access/run", "alias, 1 access/page", "alias, 1 access/run, 1 unmap/run"};
      CUdeviceptr va = c == 0 ? fresh_va : alias_va;
      std::vector<double> tm, ta, tu;
      for (int rep = 0; rep < 5; rep++) {
        if (busy) spin<<<1, 1, 0, s>>>(spin_cycles);
        double t = now_us();
        for (int i = 0; i < N; i++) CK(cuMemMap(va + i * G, G, 0, c == 0 ? fh[i] : hh[i], 0));
        double t1 = now_us();
        if (c == 2) { for (int i = 0; i < N; i++) CK(cuMemSetAccess(va + i * G, G, &acc, 1)); }
        else CK(cuMemSetAccess(va, N * G, &acc, 1));
        double t2 = now_us();
        if (c == 3) CK(cuMemUnmap(va, N * G));
        else for (int i = 0; i < N; i++) CK(cuMemUnmap(va + i * G, G));
        double t3 = now_us();
        if (busy) cudaStreamSynchronize(s);
        tm.push_back((t1 - t) / N); ta.push_back((t2 - t1) / N); tu.push_back((t3 - t2) / N);
      }
      std::sort(tm.begin(), tm.end()); std::sort(ta.begin(), ta.end()); std::sort(tu.begin(), tu.end());
      printf("%-6s %-34s %8.2f %8.2f %8.2f %8.2f\n", busy ? "busy" : "idle", names[c], tm[2], ta[2], tu[2], tm[2] + ta[2] + tu[2]);
    }
  }
  // correctness: write through the alias, read at home
  for (int i = 0; i < N; i++) CK(cuMemMap(alias_va + i * G, G, 0, hh[i], 0));
  CK(cuMemSetAccess(alias_va, N * G, &acc, 1));
  cudaMemset((void*)(alias_va + 5 * G + 100), 0x5a, 1); cudaDeviceSynchronize();
  unsigned char b = 0; cudaMemcpy(&b, (void*)(home + 5 * G + 100), 1, cudaMemcpyDeviceToHost);
  printf("alias write seen at home: %s\n", b == 0x5a ? "yes" : "NO");
  return 0;
}

static int stall_part() {
  SETUP
  size_t bytes = 1ull << 30; float4* buf; cudaMalloc(&buf, bytes); size_t n = bytes / sizeof(float4);
  const int H = 512; std::vector<CUmemGenericAllocationHandle> hs(H);
  for (auto& h : hs) CK(cuMemCreate(&h, G, &prop, 0));
  CUdeviceptr va; CK(cuMemAddressReserve(&va, H * G, 0, 0, 0));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const int K = 400;  // kernel launches per timed sequence (~ several hundred ms)
  for (int warm = 0; warm < 5; warm++) stream_kernel<<<1056, 512, 0, s>>>(buf, n);
  cudaStreamSynchronize(s);
  const char* names[] = {"host waits", "map+access+unmap runs of 8", "map+access runs of 8", "unmap runs of 8 (mapped before)"};
  printf("GPU time of %d launches of a 1 GiB streaming kernel, and host VMM work during it\n", K);
  for (int rep = 0; rep < 3; rep++) {
    for (int mode = 0; mode < 4; mode++) {
      int mapped = 0;
      if (mode == 3) {  // map everything first
        for (int i = 0; i < H; i++) CK(cuMemMap(va + i * G, G, 0, hs[i], 0));
        CK(cuMemSetAccess(va, H * G, &acc, 1));
        mapped = H;
      }
      cudaEventRecord(e0, s);
      for (int k = 0; k < K; k++) stream_kernel<<<1056, 512, 0, s>>>(buf, n);
      cudaEventRecord(e1, s);
      long ops = 0; double host_us = 0;
      int next = 0;
      while (cudaEventQuery(e1) == cudaErrorNotReady) {
        double t = now_us();
        if (mode == 1 && next + 8 <= H) {
          for (int i = 0; i < 8; i++) CK(cuMemMap(va + (next + i) * G, G, 0, hs[next + i], 0));
          CK(cuMemSetAccess(va + next * G, 8 * G, &acc, 1));
          for (int i = 0; i < 8; i++) CK(cuMemUnmap(va + (next + i) * G, G));
          next = (next + 8) % H; ops += 8;
        } else if (mode == 2 && next + 8 <= H) {
          for (int i = 0; i < 8; i++) CK(cuMemMap(va + (next + i) * G, G, 0, hs[next + i], 0));
          CK(cuMemSetAccess(va + next * G, 8 * G, &acc, 1));
          next += 8; ops += 8;
        } else if (mode == 3 && mapped > 0) {
          for (int i = 0; i < 8 && mapped > 0; i++) { mapped--; CK(cuMemUnmap(va + mapped * G, G)); ops++; }
        } else {
          host_us -= 0;  // idle poll
          continue;
        }
        host_us += now_us() - t;
      }
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      if (mode == 2) for (int i = 0; i < next; i++) CK(cuMemUnmap(va + i * G, G));
      printf("rep %d %-34s GPU %8.1f ms  pages %6ld  host VMM %8.1f ms  (%.1f us/page)\n", rep, names[mode], ms, ops, host_us / 1e3, ops ? host_us / ops : 0.0);
    }
  }
  return 0;
}

int main() {
  cudaFree(0);
  printf("Part 1: runs of k pages, us\n");
  if (runs_part()) return 1;
  printf("\nPart 2: first mappings against aliases\n");
  if (alias_part()) return 1;
  printf("\nPart 3: VMM calls while kernels run\n");
  return stall_part();
}
