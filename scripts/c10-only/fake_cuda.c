// A fake CUDA runtime and driver on host memory, for a dry run of scripts/c10-only/gpu_test.cpp
// on a machine without a GPU (scripts/build-patched-c10.sh). Not a model of a GPU: every
// operation completes at once, "device" memory is host memory (cudaMalloc: anonymous mmap),
// and the driver's virtual memory calls that gmlake uses (cuMemCreate / cuMemAddressReserve /
// cuMemMap / ...) are memfd + mmap, so a stitched range really aliases the pages it maps and a
// data round trip through it checks the mapping. Built once per CUDA major version against
// that version's headers, as libcudart.so.N (with the version node N the libraries reference)
// with libcuda.so.1 a link to the same file. Only the entry points libc10, libc10_cuda and
// gpu_test reference are defined; the ones the test does not reach return errors.
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <pthread.h>

#define EXPORT __attribute__((visibility("default")))
static const size_t TOTAL = 80ull << 30;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static size_t used = 0;
static __thread cudaError_t last_err = cudaSuccess;

struct region { void* p; size_t n; struct region* next; };
static struct region* regions = NULL;

static cudaError_t ret(cudaError_t e) { if (e != cudaSuccess) last_err = e; return e; }

EXPORT cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
EXPORT cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
EXPORT cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : ret(cudaErrorInvalidDevice); }
EXPORT cudaError_t cudaDriverGetVersion(int* v) { *v = 12080; return cudaSuccess; }
EXPORT cudaError_t cudaRuntimeGetVersion(int* v) { *v = CUDART_VERSION; return cudaSuccess; }
EXPORT cudaError_t cudaGetLastError(void) { cudaError_t e = last_err; last_err = cudaSuccess; return e; }
EXPORT cudaError_t cudaPeekAtLastError(void) { return last_err; }
EXPORT const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    default: return "cudaErrorFake";
  }
}
EXPORT const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? "out of memory" : e == cudaSuccess ? "no error" : "fake CUDA error";
}
#if CUDART_VERSION >= 12000
EXPORT cudaError_t cudaGetDeviceProperties_v2(struct cudaDeviceProp* p, int d)
#else
EXPORT cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* p, int d)
#endif
{
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "fake CUDA device (host memory, dry run)");
  p->major = 9; p->minor = 0; p->totalGlobalMem = TOTAL; p->multiProcessorCount = 132;
  return cudaSuccess;
}
EXPORT cudaError_t cudaMemGetInfo(size_t* f, size_t* t) {
  pthread_mutex_lock(&mu); *f = TOTAL - used; *t = TOTAL; pthread_mutex_unlock(&mu); return cudaSuccess;
}
EXPORT cudaError_t cudaMalloc(void** p, size_t n) {
  pthread_mutex_lock(&mu);
  if (used + n > TOTAL) { pthread_mutex_unlock(&mu); *p = NULL; return ret(cudaErrorMemoryAllocation); }
  void* m = mmap(NULL, n ? n : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) { pthread_mutex_unlock(&mu); return ret(cudaErrorMemoryAllocation); }
  struct region* r = malloc(sizeof *r); r->p = m; r->n = n ? n : 1; r->next = regions; regions = r;
  used += r->n; *p = m;
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}
EXPORT cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  pthread_mutex_lock(&mu);
  for (struct region** r = &regions; *r; r = &(*r)->next) {
    if ((*r)->p == p) { struct region* x = *r; *r = x->next; munmap(x->p, x->n); used -= x->n; free(x); pthread_mutex_unlock(&mu); return cudaSuccess; }
  }
  pthread_mutex_unlock(&mu);
  return ret(cudaErrorInvalidValue);
}
EXPORT cudaError_t cudaMemcpy(void* d, const void* s, size_t n, enum cudaMemcpyKind k) { memmove(d, s, n); return cudaSuccess; }
EXPORT cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) { memmove(d, s, n); return cudaSuccess; }
EXPORT cudaError_t cudaMemcpyPeerAsync(void* d, int dd, const void* s, int sd, size_t n, cudaStream_t st) { memmove(d, s, n); return cudaSuccess; }
EXPORT cudaError_t cudaMemset(void* d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
EXPORT cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t s) { memset(d, v, n); return cudaSuccess; }
EXPORT cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) { return cudaSuccess; }
EXPORT cudaError_t cudaStreamQuery(cudaStream_t s) { return cudaSuccess; }
EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int f) { return cudaSuccess; }
EXPORT cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int f, int p) { *s = (cudaStream_t)malloc(64); return cudaSuccess; }
EXPORT cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) { *least = 0; *greatest = -5; return cudaSuccess; }
EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus* c) { *c = cudaStreamCaptureStatusNone; return cudaSuccess; }
#if CUDART_VERSION < 12000
EXPORT cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus* c, unsigned long long* id) { *c = cudaStreamCaptureStatusNone; if (id) *id = 0; return cudaSuccess; }
#endif
EXPORT cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* m) { return cudaSuccess; }
EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int f) { *e = (cudaEvent_t)malloc(64); return cudaSuccess; }
EXPORT cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
EXPORT cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return cudaSuccess; }
EXPORT cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaSuccess; }
EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e) { return cudaSuccess; }
EXPORT cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) { *ms = 0; return cudaSuccess; }
EXPORT cudaError_t cudaDeviceEnablePeerAccess(int d, unsigned int f) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* a, const void* p) {
  memset(a, 0, sizeof *a); a->type = cudaMemoryTypeDevice; a->device = 0; a->devicePointer = (void*)p; return cudaSuccess;
}
EXPORT cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned int f) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaIpcCloseMemHandle(void* p) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t s) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaFreeAsync(void* p, cudaStream_t s) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* m, int d) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t m, enum cudaMemPoolAttr a, void* v) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t m, enum cudaMemPoolAttr a, void* v) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaMemPoolSetAccess(cudaMemPool_t m, const struct cudaMemAccessDesc* d, size_t c) { return ret(cudaErrorNotSupported); }
EXPORT cudaError_t cudaMemPoolTrimTo(cudaMemPool_t m, size_t n) { return ret(cudaErrorNotSupported); }

// ---- driver API (the entry points gmlake-cuda resolves), VMM on memfd
typedef unsigned int CUr;
struct phys { int fd; size_t size; };
static const size_t GRAN = 2u << 20;
static size_t created = 0;
EXPORT CUr cuInit(unsigned int f) { return 0; }
EXPORT CUr cuDriverGetVersion(int* v) { *v = 12080; return 0; }
EXPORT CUr cuGetErrorName(CUr e, const char** s) { *s = e == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_FAKE"; return 0; }
EXPORT CUr cuGetErrorString(CUr e, const char** s) { *s = e == 2 ? "out of memory" : "fake driver error"; return 0; }
EXPORT CUr cuDeviceGet(int* d, int o) { *d = o; return 0; }
EXPORT CUr cuDeviceGetCount(int* n) { *n = 1; return 0; }
EXPORT CUr cuDeviceGetAttribute(int* v, int a, int d) { *v = 1; return 0; }
EXPORT CUr cuDeviceTotalMem_v2(size_t* t, int d) { *t = TOTAL; return 0; }
EXPORT CUr cuDeviceCanAccessPeer(int* v, int a, int b) { *v = 0; return 0; }
static int ctx_token;
EXPORT CUr cuDevicePrimaryCtxRetain(void** c, int d) { *c = &ctx_token; return 0; }
EXPORT CUr cuDevicePrimaryCtxRelease_v2(int d) { return 0; }
EXPORT CUr cuDevicePrimaryCtxRelease(int d) { return 0; }
EXPORT CUr cuCtxGetCurrent(void** c) { *c = &ctx_token; return 0; }
EXPORT CUr cuCtxSetCurrent(void* c) { return 0; }
EXPORT CUr cuCtxSynchronize(void) { return 0; }
EXPORT CUr cuMemGetInfo_v2(size_t* f, size_t* t) { pthread_mutex_lock(&mu); *f = TOTAL - used - created; *t = TOTAL; pthread_mutex_unlock(&mu); return 0; }
EXPORT CUr cuMemGetAllocationGranularity(size_t* g, const void* prop, int flags) { *g = GRAN; return 0; }
EXPORT CUr cuMemCreate(unsigned long long* h, size_t n, const void* prop, unsigned long long f) {
  pthread_mutex_lock(&mu);
  if (n % GRAN || used + created + n > TOTAL) { pthread_mutex_unlock(&mu); return n % GRAN ? 1 : 2; }
  int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)n) != 0) { pthread_mutex_unlock(&mu); return 2; }
  struct phys* p = malloc(sizeof *p); p->fd = fd; p->size = n; created += n; *h = (unsigned long long)(uintptr_t)p;
  pthread_mutex_unlock(&mu);
  return 0;
}
EXPORT CUr cuMemRelease(unsigned long long h) {
  struct phys* p = (struct phys*)(uintptr_t)h;
  pthread_mutex_lock(&mu); created -= p->size; pthread_mutex_unlock(&mu);
  close(p->fd); free(p); return 0;
}
EXPORT CUr cuMemAddressReserve(unsigned long long* out, size_t n, size_t align, unsigned long long addr, unsigned long long f) {
  if (align < GRAN) align = GRAN;
  char* m = mmap(NULL, n + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return 2;
  uintptr_t a = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
  if (a > (uintptr_t)m) munmap(m, a - (uintptr_t)m);
  size_t tail = ((uintptr_t)m + n + align) - (a + n);
  if (tail) munmap((void*)(a + n), tail);
  *out = a; return 0;
}
EXPORT CUr cuMemAddressFree(unsigned long long p, size_t n) { munmap((void*)(uintptr_t)p, n); return 0; }
EXPORT CUr cuMemMap(unsigned long long p, size_t n, size_t off, unsigned long long h, unsigned long long f) {
  struct phys* ph = (struct phys*)(uintptr_t)h;
  void* m = mmap((void*)(uintptr_t)p, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, ph->fd, (off_t)off);
  return m == MAP_FAILED ? 1 : 0;
}
EXPORT CUr cuMemUnmap(unsigned long long p, size_t n) {
  void* m = mmap((void*)(uintptr_t)p, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return m == MAP_FAILED ? 1 : 0;
}
EXPORT CUr cuMemSetAccess(unsigned long long p, size_t n, const void* d, size_t c) { return 0; }
EXPORT CUr cuMemExportToShareableHandle(void* out, unsigned long long h, int type, unsigned long long f) {
  *(int*)out = dup(((struct phys*)(uintptr_t)h)->fd); return 0;
}
EXPORT CUr cuMemImportFromShareableHandle(unsigned long long* h, void* os, int type) {
  int fd = dup((int)(intptr_t)os); struct stat st; fstat(fd, &st);
  struct phys* p = malloc(sizeof *p); p->fd = fd; p->size = (size_t)st.st_size; *h = (unsigned long long)(uintptr_t)p;
  pthread_mutex_lock(&mu); created += p->size; pthread_mutex_unlock(&mu); return 0;
}
EXPORT CUr cuEventCreate(void** e, unsigned int f) { *e = malloc(64); return 0; }
EXPORT CUr cuEventDestroy_v2(void* e) { free(e); return 0; }
EXPORT CUr cuEventRecord(void* e, void* s) { return 0; }
EXPORT CUr cuEventQuery(void* e) { return 0; }
