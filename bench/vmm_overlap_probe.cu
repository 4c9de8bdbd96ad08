// Can a stitch's driver calls leave the allocating thread? A stitch costs host time: the thread
// that allocates blocks in cuMemMap / cuMemSetAccess (25-90 us a page while kernels run) when it
// should be launching the step's work. The idea tried here: another thread makes the calls while
// the allocating thread returns the address at once, and the allocation's stream waits *on the
// device* (cuStreamWaitValue32 on a flag the mapping thread writes once the calls are done).
//   A. Does a thread making VMM calls slow another thread's launches, event calls, stream waits
//      and small copies?  Measured: no (0.99-1.08x, idle or busy GPU).
//   B. Does a stream waiting for the flag see the mapping made by another thread?  Yes: 20 of
//      20 rounds of data checked; the launching thread spent 10-28 us instead of 850-1,036 us
//      mapping 32 pages.
//   C. But PyTorch queues copies and memsets into fresh memory (`.to(device)`, `torch.zeros`),
//      and the runtime checks their destination when they are queued: a pageable host-to-device
//      copy and a cudaMemsetAsync into a range that is mapped but not yet granted access fail
//      with "invalid argument" (20 of 20 rounds), though the stream would run them after the
//      grant. So the grant, the expensive call, cannot be deferred behind a stream wait; only
//      unmaps and releases (a few percent of a step's calls) could. (Part C needs nothing of
//      B's thread to fail: the copy is refused at the call.)
// Results on an H100 (driver 580.159.04): docs/benchmarks.md, "Driver calls off the allocating
// thread".
// Build and run on the GPU machine:
//   nvcc -O2 -o probe bench/vmm_overlap_probe.cu -lcuda -lpthread && ./probe
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
#define CK(x) do { CUresult ck_ = (x); if (ck_ != CUDA_SUCCESS) { const char* ck_s; cuGetErrorString(ck_, &ck_s); \
  printf("FAIL %s: %s (line %d)\n", #x, ck_s, __LINE__); exit(1); } } while (0)
#define RT(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("FAIL %s: %s (line %d)\n", #x, \
  cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

__global__ void tiny(int* p) { if (threadIdx.x == 0) atomicAdd(p, 1); }
__global__ void fill(unsigned* p, size_t n, unsigned v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = v ^ (unsigned)i;
}
__global__ void spin(long long cycles) { long long t0 = clock64(); while (clock64() - t0 < cycles) {} }
static double now_us() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

struct Vmm {
  CUmemAllocationProp prop = {};
  CUmemAccessDesc acc = {};
  size_t G = 0;
  Vmm() {
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  void map_run(CUdeviceptr va, const std::vector<CUmemGenericAllocationHandle>& h, int from, int k) {
    for (int i = 0; i < k; i++) CK(cuMemMap(va + i * G, G, 0, h[from + i], 0));
    CK(cuMemSetAccess(va, k * G, &acc, 1));
  }
  void unmap_run(CUdeviceptr va, int k) {
    for (int i = 0; i < k; i++) CK(cuMemUnmap(va + i * G, G));
  }
};

int main() {
  CK(cuInit(0));
  RT(cudaFree(0));
  CUcontext ctx;
  CK(cuCtxGetCurrent(&ctx));
  Vmm v;
  const int K = 64, RUN = 8;
  std::vector<CUmemGenericAllocationHandle> h(K);
  for (auto& x : h) CK(cuMemCreate(&x, v.G, &v.prop, 0));
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, K * v.G, 0, 0, 0));
  cudaStream_t s, side;
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  RT(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  int* counter;
  RT(cudaMalloc(&counter, 4));
  int* pinned;
  RT(cudaMallocHost(&pinned, 4096));
  int* dsmall;
  RT(cudaMalloc(&dsmall, 4096));
  cudaEvent_t ev;
  RT(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  int clk_khz;
  RT(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
  printf("page %zu KiB; mapping thread cycles runs of %d pages (map, one set_access, unmap)\n", v.G >> 10, RUN);

  // ---- Part A: the launching thread's calls, alone and beside a mapping thread. ----
  // One "op" of the launching thread: a kernel launch, an event record and query, a stream
  // wait on it, a 64-byte host-to-device copy: the calls a PyTorch step makes between
  // allocations. The GPU is kept busy by a long kernel on `side` (as in a training step) or
  // left idle; the ops' kernels are tiny, so the launch queue does not fill within N ops.
  const int N = 2000, ROUNDS = 7;
  std::atomic<bool> stop{false};
  std::atomic<long> cycled{0};
  auto mapper = [&] {
    CK(cuCtxSetCurrent(ctx));
    while (!stop.load()) {
      v.map_run(va, h, 0, RUN);
      v.unmap_run(va, RUN);
      cycled += RUN;
    }
  };
  auto ops = [&](int n) {
    double t0 = now_us();
    for (int i = 0; i < n; i++) {
      tiny<<<1, 32, 0, s>>>(counter);
      RT(cudaEventRecord(ev, s));
      (void)cudaEventQuery(ev);
      RT(cudaStreamWaitEvent(s, ev, 0));
      RT(cudaMemcpyAsync(dsmall, pinned, 64, cudaMemcpyHostToDevice, s));
    }
    return (now_us() - t0) / n;
  };
  printf("\nPart A: host us per op of the launching thread (launch + event record/query + stream wait + 64 B copy)\n");
  printf("%-6s | %10s %10s %8s | %s\n", "gpu", "alone", "beside", "ratio", "mapping thread: us a page beside ops (alone)");
  for (int busy = 0; busy < 2; busy++) {
    std::vector<double> alone, beside, per_page, per_page_alone;
    for (int r = 0; r < ROUNDS; r++) {
      if (busy) spin<<<1, 1, 0, side>>>((long long)clk_khz * 200);  // 200 ms of GPU work
      alone.push_back(ops(N));
      RT(cudaStreamSynchronize(s));
      // The mapping thread alone, for its own rate.
      stop = false;
      cycled = 0;
      if (busy) spin<<<1, 1, 0, side>>>((long long)clk_khz * 200);
      std::thread m0(mapper);
      double t0 = now_us();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      stop = true;
      m0.join();
      per_page_alone.push_back((now_us() - t0) / std::max(1L, cycled.load()));
      RT(cudaDeviceSynchronize());
      // Both.
      stop = false;
      cycled = 0;
      if (busy) spin<<<1, 1, 0, side>>>((long long)clk_khz * 200);
      std::thread m(mapper);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      t0 = now_us();
      beside.push_back(ops(N));
      double dt = now_us() - t0;
      long pages_then = cycled.load();
      stop = true;
      m.join();
      per_page.push_back(dt / std::max(1L, pages_then));
      RT(cudaDeviceSynchronize());
    }
    printf("%-6s | %10.2f %10.2f %8.2f | %.1f (%.1f)\n", busy ? "busy" : "idle", med(alone), med(beside),
           med(beside) / med(alone), med(per_page), med(per_page_alone));
  }

  // ---- Part B: the GPU waits for the mapping, the host does not. ----
  // Each round: the launching thread queues, on stream s, a wait for flag >= round, then a
  // kernel filling the (still unmapped) range, and returns at once; the mapping thread maps
  // the range, grants access, then writes the flag. The data is read back and checked, and
  // the range unmapped. Compared with mapping on the launching thread itself.
  printf("\nPart B: stream-ordered mapping (cuStreamWaitValue32 on a host flag), %d pages a round\n", RUN * 4);
  int memops = 0;
  CUdevice dev;
  CK(cuCtxGetDevice(&dev));
  CK(cuDeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, dev));
  volatile unsigned* flag;
  CK(cuMemHostAlloc((void**)&flag, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  *flag = 0;
  CUdeviceptr dflag;
  CK(cuMemHostGetDevicePointer(&dflag, (void*)flag, 0));
  const int P = RUN * 4;
  const size_t words = P * v.G / 4;
  std::vector<unsigned> back(words);
  auto check = [&](unsigned seed) {
    RT(cudaMemcpy(back.data(), (void*)va, words * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < words; i += 4099)
      if (back[i] != (seed ^ (unsigned)i)) return false;
    return true;
  };
  printf("stream wait-value NOR supported: %d\n", memops);
  // B0: does the wait hold the stream? The host sets the flag 30 ms after queuing.
  {
    *flag = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    CK(cuStreamWaitValue32(s, dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));
    tiny<<<1, 32, 0, s>>>(counter);
    double t0 = now_us();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    bool done_early = cudaStreamQuery(s) == cudaSuccess;
    *flag = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    RT(cudaStreamSynchronize(s));
    printf("B0 wait holds the stream: %s (%.1f ms to completion)\n", done_early ? "NO" : "yes", (now_us() - t0) / 1e3);
  }
  // B1: mapped on this thread, flag set, then wait + fill queued (the wait is already met).
  {
    v.map_run(va, h, 0, P);
    *flag = 2;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    CK(cuStreamWaitValue32(s, dflag, 2, CU_STREAM_WAIT_VALUE_GEQ));
    fill<<<264, 256, 0, s>>>((unsigned*)va, words, 11);
    cudaError_t e = cudaStreamSynchronize(s);
    printf("B1 map, then wait + fill: %s\n", e == cudaSuccess ? (check(11) ? "ok" : "WRONG DATA") : cudaGetErrorString(e));
    if (e != cudaSuccess) return 1;
    v.unmap_run(va, P);
  }
  // B2: wait + fill queued first, then mapped on this same thread, then the flag.
  {
    CK(cuStreamWaitValue32(s, dflag, 3, CU_STREAM_WAIT_VALUE_GEQ));
    fill<<<264, 256, 0, s>>>((unsigned*)va, words, 12);
    v.map_run(va, h, 0, P);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *flag = 3;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    cudaError_t e = cudaStreamSynchronize(s);
    printf("B2 wait + fill queued, then map, then flag: %s\n", e == cudaSuccess ? (check(12) ? "ok" : "WRONG DATA") : cudaGetErrorString(e));
    if (e != cudaSuccess) return 1;
    v.unmap_run(va, P);
  }
  // B3: as B2 with the mapping on another thread, timed, 20 rounds.
  int bad = 0;
  std::vector<double> host_async, host_sync, total_async;
  for (int r = 4; r < 24; r++) {
    std::atomic<bool> go{false};
    std::thread m([&] {
      CK(cuCtxSetCurrent(ctx));
      while (!go.load()) {}
      v.map_run(va, h, 0, P);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      *flag = (unsigned)r;
      std::atomic_thread_fence(std::memory_order_seq_cst);
    });
    double t0 = now_us();
    CK(cuStreamWaitValue32(s, dflag, (cuuint32_t)r, CU_STREAM_WAIT_VALUE_GEQ));
    fill<<<264, 256, 0, s>>>((unsigned*)va, words, 0x9e3779b9u * r);
    double t1 = now_us();
    go = true;
    cudaError_t e = cudaStreamSynchronize(s);
    double t2 = now_us();
    m.join();
    if (e != cudaSuccess) { printf("B3 round %d: %s\n", r, cudaGetErrorString(e)); return 1; }
    host_async.push_back(t1 - t0);
    total_async.push_back(t2 - t0);
    if (!check(0x9e3779b9u * r)) bad++;
    v.unmap_run(va, P);
    t0 = now_us();
    v.map_run(va, h, 0, P);
    fill<<<264, 256, 0, s>>>((unsigned*)va, words, 7);
    host_sync.push_back(now_us() - t0);
    RT(cudaStreamSynchronize(s));
    v.unmap_run(va, P);
  }
  printf("B3 mapping thread: rounds with wrong data: %d of 20\n", bad);
  printf("launching thread's time: async %.1f us (wait + fill enqueued), sync %.1f us (map %d pages + fill); "
         "async round to completion %.1f us\n", med(host_async), med(host_sync), P, med(total_async));
  printf("%s\n", bad == 0 ? "OK" : "DATA MISMATCH");

  // ---- Part C: map on the calling thread, grant access on the mapping thread. ----
  // B's deferral breaks a host-to-device copy from pageable memory queued before the mapping
  // exists: the runtime checks the destination when the copy is queued ("invalid argument"
  // under PyTorch's `.to(device)`). cuMemMap costs ~1 us a page; the access grant is the
  // expensive part. So: map here, queue the wait, then the copies (pageable H2D, memset) and
  // the fill; the mapping thread grants access and writes the flag. Data checked.
  int badc = 0, errs = 0;
  std::vector<double> host_c, host_map;
  std::vector<unsigned> src(words);
  for (int r = 100; r < 120; r++) {
    for (size_t i = 0; i < words; i++) src[i] = (unsigned)(r * 2654435761u) ^ (unsigned)i;
    std::atomic<bool> go{false};
    std::thread m([&] {
      CK(cuCtxSetCurrent(ctx));
      while (!go.load()) {}
      CK(cuMemSetAccess(va, P * v.G, &v.acc, 1));
      std::atomic_thread_fence(std::memory_order_seq_cst);
      *flag = (unsigned)r;
      std::atomic_thread_fence(std::memory_order_seq_cst);
    });
    double t0 = now_us();
    for (int i = 0; i < P; i++) CK(cuMemMap(va + i * v.G, v.G, 0, h[i], 0));
    CK(cuStreamWaitValue32(s, dflag, (cuuint32_t)r, CU_STREAM_WAIT_VALUE_GEQ));
    host_map.push_back(now_us() - t0);
    cudaError_t e1 = cudaMemcpyAsync((void*)va, src.data(), words * 4 / 2, cudaMemcpyHostToDevice, s);
    cudaError_t e2 = cudaMemsetAsync((char*)va + words * 2, 0x5a, 4096, s);
    double t1 = now_us();
    go = true;
    cudaError_t e3 = cudaStreamSynchronize(s);
    m.join();
    host_c.push_back(t1 - t0);
    if (e1 != cudaSuccess || e2 != cudaSuccess || e3 != cudaSuccess) {
      if (errs++ == 0) printf("C round %d: copy %s, memset %s, sync %s\n", r, cudaGetErrorString(e1),
                              cudaGetErrorString(e2), cudaGetErrorString(e3));
      (void)cudaGetLastError();
    } else {
      RT(cudaMemcpy(back.data(), (void*)va, words * 4, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < words / 2; i += 4099)
        if (back[i] != src[i]) { badc++; break; }
      if (((unsigned char*)back.data())[words * 2 + 17] != 0x5a) badc++;
    }
    v.unmap_run(va, P);
  }
  printf("C map here, access on the mapping thread: rounds failed %d, wrong data %d (of 20); "
         "launching thread %.1f us to map %d pages and queue the wait (%.1f us with a pageable copy of %zu MiB "
         "and a memset)\n", errs, badc, med(host_map), P, med(host_c), words * 2 >> 20);
  printf("C: %s\n", errs ? "the runtime refuses copies into memory not yet granted access: access cannot be deferred"
                            : "copies were accepted before the grant");
  // Exit status: B's data (A and C are measurements, either answer is a result).
  return bad == 0 && badc == 0 ? 0 : 1;
}
