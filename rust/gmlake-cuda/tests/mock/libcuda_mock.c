/* A stand-in for libcuda.so, for testing gmlake-cuda on machines without a GPU.
 *
 * It implements the driver entry points gmlake-cuda resolves, with the rules of the real
 * driver that matter here (the Device trait's, which the contract suite of gmlake_core checks
 * on this mock too): a current context is required; sizes and addresses are multiples of the
 * granularity and not 0; a mapping lies in one reservation, over nothing mapped, and is at
 * most its handle's size; an unmap removes exactly one mapping; access is set on fully mapped
 * ranges only; only unmapped memory may be released (as the Device trait rules; the real
 * driver defers the release instead) and an unknown or released handle is refused; only whole,
 * empty reservations are freed. Behaviour switches
 * (environment variables, read at each call):
 *   MOCK_CUDA_INIT_FAIL=<code>   cuInit returns <code>
 *   MOCK_CUDA_NO_FD=1            cuMemCreate refuses POSIX fd handle types (NOT_SUPPORTED)
 *   MOCK_CUDA_NO_FD_ATTR=1       the device reports no POSIX fd support
 *   MOCK_CUDA_MEM=<bytes>        device memory (default 64 MiB)
 * Compile with -DMOCK_OMIT_MEMMAP to leave cuMemMap out (a "driver too old"), and with
 * -DMOCK_OMIT_HOST to leave out the host-memory calls of the host tier.
 * cuMemcpyHtoD_v2 / cuMemcpyDtoH_v2 copy through mappings (for tests/device.rs under the mock).
 * Helpers for the test (prefixed mock_) expose internal counters (live handles, mappings,
 * reservations, events: the contract suite's census). Two devices. */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
enum {
    OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
    INVALID_DEVICE = 101, INVALID_CONTEXT = 201, NOT_READY = 600, NOT_SUPPORTED = 801,
};

#define NDEV 2
#define GRAN (2u << 20)
#define MAXN 4096
/* Live mappings: active pages and kept aliases (up to `alias_floor`, 128 GiB of 2 MiB pages by
 * default), so a device of MAXN pages may hold many more mappings than pages. With 4096 the
 * table filled on the contract's four-thread case now and then, and cuMemMap failed. */
#define MAXMAPS (1 << 16)

typedef struct { int type; int id; } Loc;
typedef struct {
    int type; int requestedHandleTypes; Loc location; void *win32; unsigned char flags[8];
} Prop;
typedef struct { Loc location; int flags; } AccessDesc;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread void *current;
static int initialized;
static int ctx_storage[NDEV];
static int primary_refs[NDEV];
static long set_current_calls;

/* Device memory behind handles: shared by a handle and its imports, freed (and uncounted) when
 * the last handle to it is released. Its bytes are allocated at the first copy. */
typedef struct { char *p; size_t size; int refs; } Mem;
/* Slots of released handles, reservations and mappings are reused, so a long run never fills
 * the tables; handle ids are never reused (a released id stays unknown). */
static struct { unsigned long long id; size_t size; int maps; int live; int fd_type; Mem *mem; } allocs[MAXN];
static int nallocs;
static unsigned long long next_handle = 0x1000;
static long events_live;
static size_t used;
static struct { unsigned long long addr; size_t size; int live; } resv[MAXN];
static int nresv;
static unsigned long long next_va = 0x7f0000000000ull;
static struct { unsigned long long addr; size_t size; int ai; int live; } maps[MAXMAPS];
static int nmaps;
static int last_access_count;
static int last_access_ids[8];
static struct { int fd; int ai; unsigned long long id; } exported[MAXN];
static int nexported;

typedef struct { unsigned magic; int pending; long recorded_at; void *ctx; } Event;
static long syncs; /* cuCtxSynchronize calls: completes every event recorded before */
#define EVENT_MAGIC 0xe7e7e7e7u

static int free_slot_alloc(void);
static size_t mem_limit(void) {
    const char *s = getenv("MOCK_CUDA_MEM");
    return s ? (size_t)strtoull(s, 0, 10) : (64u << 20);
}
static int has_ctx(void) { return current != 0; }
/* 0 (the legacy default stream), CU_STREAM_LEGACY (0x1), CU_STREAM_PER_THREAD (0x2), or the
 * mock's one created stream, 0x5157. */
static int valid_stream(void *s) {
    uintptr_t v = (uintptr_t)s;
    return v == 0 || v == 1 || v == 2 || v == 0x5157;
}
static int dev_of_ctx(void *c) {
    for (int i = 0; i < NDEV; i++) if (c == &ctx_storage[i]) return i;
    return -1;
}

CUresult cuInit(unsigned flags) {
    const char *f = getenv("MOCK_CUDA_INIT_FAIL");
    if (f) return atoi(f);
    if (flags) return INVALID_VALUE;
    initialized = 1;
    return OK;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }

static const char *names[][2] = {
    {"CUDA_SUCCESS", "no error"},
    {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
};
CUresult cuGetErrorName(CUresult e, const char **s) {
    if (e >= 0 && e <= 2) { *s = names[e][0]; return OK; }
    if (e == NO_DEVICE) { *s = "CUDA_ERROR_NO_DEVICE"; return OK; }
    if (e == INVALID_CONTEXT) { *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK; }
    if (e == NOT_SUPPORTED) { *s = "CUDA_ERROR_NOT_SUPPORTED"; return OK; }
    *s = 0;
    return INVALID_VALUE;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
    if (e >= 0 && e <= 2) { *s = names[e][1]; return OK; }
    if (e == NO_DEVICE) { *s = "no CUDA-capable device is detected"; return OK; }
    *s = 0;
    return INVALID_VALUE;
}

CUresult cuDeviceGetCount(int *n) { if (!initialized) return NOT_INITIALIZED; *n = NDEV; return OK; }
CUresult cuDeviceGet(int *d, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= NDEV) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    if (dev < 0 || dev >= NDEV) return INVALID_DEVICE;
    if (attr == 102) *v = 1;
    else if (attr == 103) *v = getenv("MOCK_CUDA_NO_FD_ATTR") ? 0 : 1;
    else *v = 0;
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *b, int dev) {
    if (dev < 0 || dev >= NDEV) return INVALID_DEVICE;
    *b = mem_limit();
    return OK;
}
CUresult cuDeviceCanAccessPeer(int *can, int dev, int peer) {
    if (dev < 0 || dev >= NDEV || peer < 0 || peer >= NDEV) return INVALID_DEVICE;
    *can = 1;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (dev < 0 || dev >= NDEV) return INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    primary_refs[dev]++;
    pthread_mutex_unlock(&mu);
    *ctx = &ctx_storage[dev];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
    if (dev < 0 || dev >= NDEV) return INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    CUresult r = primary_refs[dev] > 0 ? (primary_refs[dev]--, OK) : INVALID_CONTEXT;
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return OK; }
CUresult cuCtxSetCurrent(void *ctx) {
    if (ctx && dev_of_ctx(ctx) < 0) return INVALID_CONTEXT;
    __atomic_add_fetch(&set_current_calls, 1, __ATOMIC_SEQ_CST);
    current = ctx;
    return OK;
}
CUresult cuCtxSynchronize(void) {
    if (!has_ctx()) return INVALID_CONTEXT;
    __atomic_add_fetch(&syncs, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    if (!has_ctx()) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    *free = mem_limit() - used;
    *total = mem_limit();
    pthread_mutex_unlock(&mu);
    return OK;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *p, int option) {
    if (p->type != 1 || p->location.type != 1 || option < 0 || option > 1) return INVALID_VALUE;
    *g = GRAN;
    return OK;
}
CUresult cuMemCreate(unsigned long long *h, size_t size, const Prop *p, unsigned long long flags) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (flags || p->type != 1 || p->location.type != 1 || size == 0 || size % GRAN) return INVALID_VALUE;
    if (p->location.id < 0 || p->location.id >= NDEV) return INVALID_DEVICE;
    if (p->requestedHandleTypes != 0 && getenv("MOCK_CUDA_NO_FD")) return NOT_SUPPORTED;
    pthread_mutex_lock(&mu);
    CUresult r = OK;
    int slot = free_slot_alloc();
    if (used + size > mem_limit()) r = OUT_OF_MEMORY;
    else if (slot < 0) r = OUT_OF_MEMORY;
    else {
        Mem *m = calloc(1, sizeof *m);
        m->size = size;
        m->refs = 1;
        allocs[slot].id = next_handle++;
        allocs[slot].size = size;
        allocs[slot].maps = 0;
        allocs[slot].live = 1;
        allocs[slot].fd_type = p->requestedHandleTypes == 1;
        allocs[slot].mem = m;
        *h = allocs[slot].id;
        used += size;
    }
    pthread_mutex_unlock(&mu);
    return r;
}
static int free_slot_alloc(void) {
    for (int i = 0; i < nallocs; i++) if (!allocs[i].live) return i;
    return nallocs < MAXN ? nallocs++ : -1;
}
static int find_alloc(unsigned long long h) {
    for (int i = 0; i < nallocs; i++) if (allocs[i].live && allocs[i].id == h) return i;
    return -1;
}
CUresult cuMemRelease(unsigned long long h) {
    if (!has_ctx()) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    int i = find_alloc(h);
    CUresult r = OK;
    if (i < 0 || allocs[i].maps) r = INVALID_VALUE;
    else {
        Mem *m = allocs[i].mem;
        allocs[i].live = 0;
        allocs[i].mem = 0;
        if (--m->refs == 0) { used -= m->size; free(m->p); free(m); }
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuMemAddressReserve(unsigned long long *ptr, size_t size, size_t align,
                             unsigned long long addr, unsigned long long flags) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (size == 0 || size % GRAN || addr || flags || (align & (align - 1))) return INVALID_VALUE;
    if (align < GRAN) align = GRAN;
    pthread_mutex_lock(&mu);
    CUresult r = OK;
    int slot = -1;
    for (int i = 0; i < nresv && slot < 0; i++) if (!resv[i].live) slot = i;
    if (slot < 0 && nresv < MAXN) slot = nresv++;
    if (slot < 0) r = OUT_OF_MEMORY;
    else {
        unsigned long long a = (next_va + align - 1) / align * align;
        resv[slot].addr = a; resv[slot].size = size; resv[slot].live = 1;
        next_va = a + size + GRAN; /* a gap, so adjacent reservations are distinct */
        *ptr = a;
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuMemAddressFree(unsigned long long addr, size_t size) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (addr == 0xdead00000000ull) return 999; /* a code no binding knows */
    pthread_mutex_lock(&mu);
    CUresult r = INVALID_VALUE;
    for (int i = 0; i < nresv; i++) {
        if (resv[i].live && resv[i].addr == addr && resv[i].size == size) {
            int busy = 0;
            for (int m = 0; m < nmaps; m++)
                if (maps[m].live && maps[m].addr >= addr && maps[m].addr < addr + size) busy = 1;
            if (!busy) { resv[i].live = 0; r = OK; }
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}
#ifndef MOCK_OMIT_MEMMAP
CUresult cuMemMap(unsigned long long addr, size_t size, size_t offset, unsigned long long h,
                  unsigned long long flags) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (offset || flags || size == 0 || size % GRAN || addr % GRAN) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = INVALID_VALUE;
    int ai = find_alloc(h);
    int inside = 0;
    for (int i = 0; i < nresv; i++)
        if (resv[i].live && addr >= resv[i].addr && addr + size <= resv[i].addr + resv[i].size)
            inside = 1;
    int overlap = 0;
    for (int m = 0; m < nmaps; m++)
        if (maps[m].live && addr < maps[m].addr + maps[m].size && maps[m].addr < addr + size)
            overlap = 1;
    int slot = -1;
    for (int m = 0; m < nmaps && slot < 0; m++) if (!maps[m].live) slot = m;
    if (slot < 0 && nmaps < MAXMAPS) slot = nmaps++;
    if (ai >= 0 && inside && !overlap && size <= allocs[ai].size && slot >= 0) {
        maps[slot].addr = addr; maps[slot].size = size; maps[slot].ai = ai;
        maps[slot].live = 1;
        allocs[ai].maps++;
        r = OK;
    }
    pthread_mutex_unlock(&mu);
    return r;
}
#endif
CUresult cuMemUnmap(unsigned long long addr, size_t size) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (size == 0 || size % GRAN || addr % GRAN) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = INVALID_VALUE;
    for (int m = 0; m < nmaps; m++) {
        if (maps[m].live && maps[m].addr == addr && maps[m].size == size) {
            maps[m].live = 0;
            allocs[maps[m].ai].maps--;
            r = OK;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuMemSetAccess(unsigned long long addr, size_t size, const AccessDesc *d, size_t n) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (n == 0 || n > 8 || size == 0 || size % GRAN || addr % GRAN) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    /* Every byte of the range must be mapped. */
    unsigned long long a = addr;
    CUresult r = OK;
    while (a < addr + size) {
        int found = 0;
        for (int m = 0; m < nmaps; m++)
            if (maps[m].live && maps[m].addr == a) { a += maps[m].size; found = 1; break; }
        if (!found) { r = INVALID_VALUE; break; }
    }
    if (r == OK) {
        for (size_t i = 0; i < n; i++) {
            if (d[i].location.type != 1 || d[i].flags != 3) r = INVALID_VALUE;
            last_access_ids[i] = d[i].location.id;
        }
        last_access_count = (int)n;
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type,
                                      unsigned long long flags) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (type != 1 || flags) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    int ai = find_alloc(h);
    CUresult r = INVALID_VALUE;
    if (ai >= 0 && allocs[ai].fd_type && nexported < MAXN) {
        int fd = open("/dev/null", O_RDONLY);
        exported[nexported].fd = fd; exported[nexported].ai = ai;
        exported[nexported].id = h; nexported++;
        *(int *)out = fd;
        r = OK;
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os, int type) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (type != 1) return INVALID_VALUE;
    int fd = (int)(intptr_t)os;
    pthread_mutex_lock(&mu);
    CUresult r = INVALID_VALUE;
    for (int i = 0; i < nexported; i++) {
        int from = exported[i].ai;
        if (exported[i].fd == fd && allocs[from].live && allocs[from].id == exported[i].id) {
            /* A second handle onto the same memory: counts no extra bytes. */
            int slot = free_slot_alloc();
            if (slot < 0) { r = OUT_OF_MEMORY; break; }
            allocs[slot] = allocs[from];
            allocs[slot].id = next_handle++;
            allocs[slot].maps = 0;
            allocs[slot].mem->refs++;
            *h = allocs[slot].id;
            r = OK;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuEventCreate(void **ev, unsigned flags) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (flags != 2) return INVALID_VALUE; /* gmlake asks for CU_EVENT_DISABLE_TIMING only */
    Event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    e->ctx = current;
    __atomic_add_fetch(&events_live, 1, __ATOMIC_SEQ_CST);
    *ev = e;
    return OK;
}
CUresult cuEventDestroy_v2(void *ev) {
    Event *e = ev;
    if (!e || e->magic != EVENT_MAGIC) return INVALID_VALUE;
    e->magic = 0;
    free(e);
    __atomic_sub_fetch(&events_live, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuEventRecord(void *ev, void *stream) {
    Event *e = ev;
    if (!has_ctx()) return INVALID_CONTEXT;
    if (!e || e->magic != EVENT_MAGIC) return INVALID_VALUE;
    if (!valid_stream(stream)) return INVALID_VALUE;
    e->pending = 1;
    e->recorded_at = __atomic_load_n(&syncs, __ATOMIC_SEQ_CST);
    return OK;
}
/* The mock runs nothing, so there is nothing to order: the wait's arguments are checked. */
CUresult cuStreamWaitEvent(void *stream, void *ev, unsigned int flags) {
    Event *e = ev;
    if (!has_ctx()) return INVALID_CONTEXT;
    if (!e || e->magic != EVENT_MAGIC) return INVALID_VALUE;
    if (!valid_stream(stream) || flags != 0) return INVALID_VALUE;
    return OK;
}
CUresult cuEventQuery(void *ev) {
    Event *e = ev;
    if (!has_ctx()) return INVALID_CONTEXT;
    if (!e || e->magic != EVENT_MAGIC) return INVALID_VALUE;
    if (e->pending && __atomic_load_n(&syncs, __ATOMIC_SEQ_CST) > e->recorded_at) e->pending = 0;
    if (e->pending) { e->pending = 0; return NOT_READY; } /* completes at the second query */
    return OK;
}

/* Copies through the mappings (the memory behind a page is shared by all its mappings). */
static char *translate(unsigned long long a, size_t *room) {
    for (int m = 0; m < nmaps; m++)
        if (maps[m].live && a >= maps[m].addr && a < maps[m].addr + maps[m].size) {
            Mem *mem = allocs[maps[m].ai].mem;
            *room = maps[m].addr + maps[m].size - a;
            if (!mem->p) mem->p = calloc(1, mem->size);
            return mem->p + (a - maps[m].addr);
        }
    return 0;
}
static CUresult copy(char *host, unsigned long long dev, size_t n, int to_dev) {
    if (!has_ctx()) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    CUresult r = OK;
    while (n) {
        size_t room;
        char *p = translate(dev, &room);
        if (!p) { r = INVALID_VALUE; break; }
        size_t k = n < room ? n : room;
        if (to_dev) memcpy(p, host, k); else memcpy(host, p, k);
        host += k; dev += k; n -= k;
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n) {
    return copy((char *)src, dst, n, 1);
}
CUresult cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) {
    return copy(dst, src, n, 0);
}

/* Pinned host memory and asynchronous copies (run at once: a stream of the mock has no
 * queue). Compile with -DMOCK_OMIT_HOST to leave them out. */
#ifndef MOCK_OMIT_HOST
static long host_live;
CUresult cuMemHostAlloc(void **pp, size_t size, unsigned flags) {
    if (!has_ctx()) return INVALID_CONTEXT;
    if (flags != 0 || size == 0) return INVALID_VALUE;
    *pp = calloc(1, size);
    if (!*pp) return OUT_OF_MEMORY;
    __atomic_add_fetch(&host_live, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuMemFreeHost(void *p) {
    if (!has_ctx()) return INVALID_CONTEXT;
    free(p);
    __atomic_sub_fetch(&host_live, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, unsigned long long src, size_t n, void *stream) {
    if (!valid_stream(stream)) return INVALID_VALUE;
    return copy(dst, src, n, 0);
}
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream) {
    if (!valid_stream(stream)) return INVALID_VALUE;
    return copy((char *)src, dst, n, 1);
}
CUresult cuEventSynchronize(void *ev) {
    Event *e = ev;
    if (!e || e->magic != EVENT_MAGIC) return INVALID_VALUE;
    e->pending = 0;
    return OK;
}
long mock_host_live(void) { return __atomic_load_n(&host_live, __ATOMIC_SEQ_CST); }
#endif

/* Test helpers. */
int mock_primary_refs(int dev) { return primary_refs[dev]; }
long mock_set_current_calls(void) { return __atomic_load_n(&set_current_calls, __ATOMIC_SEQ_CST); }
void *mock_ctx_of(int dev) { return &ctx_storage[dev]; }
int mock_last_access(int *ids) {
    for (int i = 0; i < last_access_count; i++) ids[i] = last_access_ids[i];
    return last_access_count;
}
size_t mock_used(void) { return used; }
int mock_live_mappings(void) {
    pthread_mutex_lock(&mu);
    int n = 0;
    for (int m = 0; m < nmaps; m++) n += maps[m].live;
    pthread_mutex_unlock(&mu);
    return n;
}
int mock_live_handles(void) {
    pthread_mutex_lock(&mu);
    int n = 0;
    for (int i = 0; i < nallocs; i++) n += allocs[i].live;
    pthread_mutex_unlock(&mu);
    return n;
}
int mock_live_reservations(void) {
    pthread_mutex_lock(&mu);
    int n = 0;
    for (int i = 0; i < nresv; i++) n += resv[i].live;
    pthread_mutex_unlock(&mu);
    return n;
}
long mock_live_events(void) { return __atomic_load_n(&events_live, __ATOMIC_SEQ_CST); }
