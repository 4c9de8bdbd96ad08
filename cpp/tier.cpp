// The host tier (issue 16) for PyTorch tensors: C functions Python calls with ctypes
// (python/gmlake/tier.py), over one gmlake::ffi::GmlakeTier per device (rust/gmlake-ffi's
// bridge, over the device's gmlake allocator).
//
// Tensors cross ctypes as the address of their c10::StorageImpl (`storage._cdata`):
//
// - put(storage, stream, next_use): the storage's memory must have been allocated by gmlake
//   (its DataPtr's deleter is gmlake's; otherwise an error naming that). The tier adopts the
//   allocation and the storage's DataPtr gets the tier's deleter: the memory stays valid for
//   every tensor on the storage; when the storage dies, the tensor becomes *put* (evictable to
//   pinned host memory) instead of freed. Returns a handle (> 0). A second put of a storage
//   the tier holds already gives another handle on the same tier tensor. Each handle keeps
//   its own next_use; the tensor's is the earliest among its handles (so re-putting a tensor
//   got from the tier with a later next_use, then freeing the old handle, re-declares it).
// - get(handle, stream): the tier makes the tensor resident again (copied back on `stream`,
//   possibly at a new address) and returns the pointer; Python wraps it in a storage of its
//   own (torch._C._construct_storage_from_data_pointer) and bind() gives that storage the
//   tier's deleter. While any storage of a tier tensor lives, the tensor is resident (never
//   evicted); when the last one dies it is put again (its handles remain) or freed (none).
// - free(handle): drops the handle; the tier tensor goes when no handle or storage is left.
//
// Stream order: copies are queued on the stream passed (the caller's current stream); what
// get returns is safe to use on that stream (see rust/gmlake-ffi/src/tier.rs).
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "gmlake_impl.h"

#define GMLAKE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using gmlake::Impl;
namespace ffi = gmlake::ffi;

thread_local std::string t_error;

int fail(const std::string& msg) {
  t_error = msg;
  return -1;
}

struct Entry {
  int device = 0;
  uint64_t id = 0; // the tier's tensor id
  uint64_t nbytes = 0;
  int live = 0; // storages alive (the adopted one, and those bound by get), gets not yet bound
  int handles = 0;
  int64_t next_use = -1; // the earliest next_use of its handles (-1: none declared)
  bool is_put = false; // put in the tier (no storage alive since)
};

struct Handle {
  uint64_t key;     // into g_entries
  int64_t next_use; // as declared by the put that made it (-1: none)
};

// The deleter's context: which entry a storage holds.
struct StorageCtx {
  uint64_t key;
};

// Guards everything below. Recursive: a put that materializes a copy-on-write storage may
// allocate, and an allocation out of memory calls relieve() on the same thread.
std::recursive_mutex g_mu;
std::map<uint64_t, Entry> g_entries; // key -> entry
std::map<int64_t, Handle> g_handles;
uint64_t g_next_key = 1;
int64_t g_next_handle = 1;
ffi::GmlakeTier* g_tiers[Impl::kMaxDevices] = {};
ffi::TierConf g_default_conf; // for tiers created by a put before any configure

bool relieve(int device, uint64_t bytes);

ffi::GmlakeTier& tier_of(int device) {
  TORCH_CHECK(device >= 0 && device < Impl::kMaxDevices, "gmlake tier: bad device ", device);
  ffi::GmlakeTier* t = g_tiers[device];
  if (t != nullptr) {
    return *t;
  }
  Impl* impl = Impl::instance();
  TORCH_CHECK(impl != nullptr, "gmlake tier: gmlake is not enabled (call gmlake.enable() first)");
  const ffi::Gmlake& core = impl->core_of(device);
  try {
    // Leaked on purpose, as the allocator: storages may die during interpreter shutdown.
    t = core.new_tier(g_default_conf).into_raw();
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "gmlake tier: ", e.what());
  }
  g_tiers[device] = t;
  // Out of memory in the allocator: evict put tensors first (relieve, below).
  gmlake::set_tier_relief(&relieve);
  return *t;
}

// Called with g_mu held, after `live` or `handles` dropped.
void settle(uint64_t key) {
  auto it = g_entries.find(key);
  if (it == g_entries.end()) {
    return;
  }
  Entry& e = it->second;
  if (e.live > 0) {
    return;
  }
  ffi::GmlakeTier& t = *g_tiers[e.device];
  if (e.handles > 0) {
    if (!e.is_put) {
      t.put(e.id, e.next_use);
      e.is_put = true;
    }
  } else {
    const uint64_t id = e.id;
    g_entries.erase(it);
    t.free(id);
  }
}

void tier_storage_delete(void* ctx) {
  auto* c = static_cast<StorageCtx*>(ctx);
  if (c == nullptr) {
    return;
  }
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto it = g_entries.find(c->key);
    if (it != g_entries.end()) {
      it->second.live -= 1;
      settle(c->key);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[gmlake] tier: error while releasing a tensor: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "[gmlake] tier: unknown error while releasing a tensor\n");
  }
  delete c;
}

bool relieve(int device, uint64_t bytes) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    if (device < 0 || device >= Impl::kMaxDevices || g_tiers[device] == nullptr) {
      return false;
    }
    return g_tiers[device]->relieve(bytes) > 0;
  } catch (...) {
    return false;
  }
}

ffi::TierConf make_conf(
    int has_budget,
    uint64_t budget,
    const char* policy,
    double bandwidth,
    uint64_t host_cache,
    int64_t prefetch_margin,
    double tick_seconds) {
  ffi::TierConf c;
  c.has_budget = has_budget != 0;
  c.budget = budget;
  c.policy = rust::String(policy == nullptr ? "" : policy);
  c.bandwidth = bandwidth;
  c.host_cache = host_cache;
  c.prefetch_margin = prefetch_margin < 0 ? 1 : static_cast<uint64_t>(prefetch_margin);
  c.tick_seconds = tick_seconds;
  return c;
}

} // namespace

// The last error of a gmlake_tier_* call on this thread.
GMLAKE_EXPORT const char* gmlake_tier_last_error() {
  return t_error.c_str();
}

// Sets the tier of `device` (created if needed): budget (has_budget 0: none), policy ("aware"
// or "lru"), bandwidth in bytes/s (0: default), bytes of pinned buffers kept for reuse,
// prefetch margin in ticks (< 0: default), seconds per tick (0: default). Also the settings of
// tiers created later by a put. 0 or -1.
GMLAKE_EXPORT int gmlake_tier_configure(
    int device,
    int has_budget,
    uint64_t budget,
    const char* policy,
    double bandwidth,
    uint64_t host_cache,
    int64_t prefetch_margin,
    double tick_seconds) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    ffi::TierConf c =
        make_conf(has_budget, budget, policy, bandwidth, host_cache, prefetch_margin, tick_seconds);
    if (device < 0 || device >= Impl::kMaxDevices) {
      return fail("gmlake.tier.configure: bad device " + std::to_string(device));
    }
    // Checked first (a bad policy is refused before anything changes).
    ffi::TierConf previous = g_default_conf;
    g_default_conf = c;
    try {
      if (g_tiers[device] != nullptr) {
        g_tiers[device]->reconfigure(c);
      } else {
        (void)tier_of(device);
      }
    } catch (...) {
      g_default_conf = previous;
      throw;
    }
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// Hands the storage (a c10::StorageImpl*) of a CUDA tensor to the tier; `stream`: the stream
// it was last used on (the current one); next_use < 0: none declared. The handle, or -1.
GMLAKE_EXPORT int64_t gmlake_tier_put(void* storage_impl, uint64_t stream, int64_t next_use) {
  try {
    auto* st = static_cast<c10::StorageImpl*>(storage_impl);
    if (st == nullptr) {
      return fail("gmlake.tier.put: no storage");
    }
    const c10::DataPtr& dp = st->data_ptr();
    if (dp.device().type() != c10::DeviceType::CUDA) {
      return fail("gmlake.tier.put: the tensor is not on a CUDA device");
    }
    if (dp.get() == nullptr || st->nbytes() == 0) {
      return fail("gmlake.tier.put: the tensor has no memory (empty storage)");
    }
    const int device = dp.device().index();
    std::lock_guard<std::recursive_mutex> g(g_mu);
    uint64_t key = 0;
    if (dp.get_deleter() == &tier_storage_delete) {
      key = static_cast<StorageCtx*>(dp.get_context())->key;
      Entry& e = g_entries.at(key);
      e.handles += 1;
      if (next_use >= 0 && (e.next_use < 0 || next_use < e.next_use)) {
        e.next_use = next_use;
      }
    } else if (dp.get_deleter() == &gmlake::local_raw_delete) {
      ffi::GmlakeTier& t = tier_of(device);
      void* raw = dp.get();
      const c10::Device dev = dp.device();
      const uint64_t ptr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(raw));
      const uint64_t nbytes = st->nbytes();
      key = g_next_key++;
      // The storage gets the tier's deleter first (this may throw: nothing happened then),
      // then the tier adopts the allocation; if it refuses, gmlake's DataPtr goes back.
      auto* ctx = new StorageCtx{key};
      c10::DataPtr old;
      try {
        old = st->set_data_ptr(c10::DataPtr(raw, ctx, &tier_storage_delete, dev));
      } catch (...) {
        delete ctx;
        throw;
      }
      uint64_t id = 0;
      try {
        id = t.adopt(ptr, nbytes, stream);
      } catch (const rust::Error& e) {
        c10::DataPtr mine = st->set_data_ptr(std::move(old));
        (void)mine.release_context();
        delete ctx;
        return fail(std::string("gmlake.tier.put: ") + e.what());
      }
      // The tier owns the allocation now: gmlake's deleter must not free it.
      (void)old.release_context();
      Entry e;
      e.device = device;
      e.id = id;
      e.nbytes = nbytes;
      e.live = 1;
      e.handles = 1;
      e.next_use = next_use;
      g_entries[key] = e;
    } else {
      return fail(
          "gmlake.tier.put: the tensor's memory was not allocated by gmlake (is gmlake the "
          "CUDA allocator of this process, enabled before the tensor was made?)");
    }
    const int64_t h = g_next_handle++;
    g_handles[h] = Handle{key, next_use};
    return h;
  } catch (const std::exception& e) {
    return fail(std::string("gmlake.tier.put: ") + e.what());
  }
}

// Makes the tensor of `handle` resident for use on `stream`: *ptr, *nbytes, *device. Each
// successful get must be followed by gmlake_tier_bind or gmlake_tier_unget. 0 or -1.
GMLAKE_EXPORT int gmlake_tier_get(
    int64_t handle,
    uint64_t stream,
    uint64_t* ptr,
    uint64_t* nbytes,
    int* device) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto h = g_handles.find(handle);
    if (h == g_handles.end()) {
      return fail("gmlake.tier.get: unknown handle " + std::to_string(handle) + " (freed?)");
    }
    Entry& e = g_entries.at(h->second.key);
    ffi::TierFetch f;
    try {
      f = g_tiers[e.device]->get(e.id, stream);
    } catch (const rust::Error& err) {
      return fail(std::string("gmlake.tier.get: ") + err.what());
    }
    e.live += 1;
    e.is_put = false;
    *ptr = f.ptr;
    *nbytes = e.nbytes;
    *device = e.device;
    return 0;
  } catch (const std::exception& err) {
    return fail(std::string("gmlake.tier.get: ") + err.what());
  }
}

// Gives a storage made over the pointer of a get (its DataPtr deletes nothing) the tier's
// deleter. 0 or -1 (then call gmlake_tier_unget).
GMLAKE_EXPORT int gmlake_tier_bind(void* storage_impl, int64_t handle) {
  try {
    auto* st = static_cast<c10::StorageImpl*>(storage_impl);
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto h = g_handles.find(handle);
    if (h == g_handles.end() || st == nullptr) {
      return fail("gmlake.tier.bind: unknown handle or no storage");
    }
    const c10::DataPtr& dp = st->data_ptr();
    if (dp.get_context() != nullptr) {
      return fail("gmlake.tier.bind: the storage owns its memory already");
    }
    auto* ctx = new StorageCtx{h->second.key};
    st->set_data_ptr_noswap(c10::DataPtr(dp.get(), ctx, &tier_storage_delete, dp.device()));
    return 0;
  } catch (const std::exception& e) {
    return fail(std::string("gmlake.tier.bind: ") + e.what());
  }
}

// Undoes the reference a get took, when no storage could be bound to it.
GMLAKE_EXPORT int gmlake_tier_unget(int64_t handle) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto h = g_handles.find(handle);
    if (h == g_handles.end()) {
      return fail("gmlake.tier.unget: unknown handle");
    }
    const uint64_t key = h->second.key;
    g_entries.at(key).live -= 1;
    settle(key);
    return 0;
  } catch (const std::exception& e) {
    return fail(std::string("gmlake.tier.unget: ") + e.what());
  }
}

// Drops a handle. 0 or -1 (unknown handle).
GMLAKE_EXPORT int gmlake_tier_free(int64_t handle) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto h = g_handles.find(handle);
    if (h == g_handles.end()) {
      return fail("gmlake.tier.free: unknown handle " + std::to_string(handle) + " (freed twice?)");
    }
    const uint64_t key = h->second.key;
    const int64_t gone_use = h->second.next_use;
    g_handles.erase(h);
    Entry& e = g_entries.at(key);
    e.handles -= 1;
    if (e.handles > 0 && gone_use >= 0 && gone_use == e.next_use) {
      // The earliest next_use may have gone with the handle: the earliest of the rest.
      int64_t earliest = -1;
      for (const auto& kv : g_handles) {
        const int64_t u = kv.second.next_use;
        if (kv.second.key == key && u >= 0 && (earliest < 0 || u < earliest)) {
          earliest = u;
        }
      }
      if (earliest != e.next_use) {
        e.next_use = earliest;
        if (e.is_put) {
          g_tiers[e.device]->set_next_use(e.id, e.next_use);
        }
      }
    }
    settle(key);
    return 0;
  } catch (const std::exception& e) {
    return fail(std::string("gmlake.tier.free: ") + e.what());
  }
}

// Where the tensor of a handle is: 0 resident, 1 put, 2 evicting, 3 evicted, 4 fetching; -1
// unknown handle.
GMLAKE_EXPORT int gmlake_tier_state(int64_t handle) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto h = g_handles.find(handle);
    if (h == g_handles.end()) {
      return fail("gmlake.tier.state: unknown handle");
    }
    const Entry& e = g_entries.at(h->second.key);
    return static_cast<int>(g_tiers[e.device]->state(e.id));
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// Moves the clock of `device`'s tier (prefetches what is due). 0 or -1.
GMLAKE_EXPORT int gmlake_tier_advance(int device, uint64_t now) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    tier_of(device).advance(now);
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// Waits for the device and completes every copy of `device`'s tier; with trim, also frees the
// pinned buffers kept for reuse. 0 or -1.
GMLAKE_EXPORT int gmlake_tier_flush(int device, int trim) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    ffi::GmlakeTier& t = tier_of(device);
    t.flush();
    if (trim != 0) {
      t.trim_host_cache();
    }
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// Checks the tier's invariants (tests). 0 or -1.
GMLAKE_EXPORT int gmlake_tier_verify(int device) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    tier_of(device).verify();
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// The statistics of `device`'s tier as JSON, copied into buf (NUL-terminated, truncated to
// len); returns the full length, or -1.
GMLAKE_EXPORT long long gmlake_tier_stats_json(int device, char* buf, size_t len) {
  try {
    std::string s;
    {
      std::lock_guard<std::recursive_mutex> g(g_mu);
      s = std::string(tier_of(device).stats_json());
      size_t handles = g_handles.size();
      s.pop_back();
      s += ",\"handles\":" + std::to_string(handles) + "}";
    }
    if (buf != nullptr && len > 0) {
      const size_t n = std::min(len - 1, s.size());
      std::memcpy(buf, s.data(), n);
      buf[n] = '\0';
    }
    return static_cast<long long>(s.size());
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// ---- Test hooks (cpp/tests/tier_test.cpp): the logic above over a simulated device, without
// a GPU or an installed gmlake.

namespace {
ffi::Gmlake* g_sim = nullptr;
} // namespace

// Device 0's tier over a simulated allocator of `capacity` bytes, LRU, with `budget` (0:
// none). Only before any tier exists. 0 or -1.
GMLAKE_EXPORT int gmlake_tier_test_simulated(uint64_t capacity, uint64_t budget) {
  try {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    if (g_tiers[0] != nullptr) {
      return fail("gmlake_tier_test_simulated: device 0 has a tier already");
    }
    g_sim = ffi::new_simulated_allocator(capacity, 0, rust::Str("")).into_raw();
    ffi::TierConf c = make_conf(budget != 0, budget, "lru", 0.0, 0, -1, 0.0);
    g_tiers[0] = g_sim->new_tier(c).into_raw();
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// A storage (refcount 1, released to the caller) of `nbytes` allocated from the simulated
// allocator, with gmlake's deleter, on "CUDA device 0"; nullptr on failure.
GMLAKE_EXPORT void* gmlake_tier_test_storage(uint64_t nbytes) {
  try {
    if (g_sim == nullptr) {
      fail("gmlake_tier_test_storage: no simulated tier");
      return nullptr;
    }
    ffi::AllocOutcome r = g_sim->allocate(nbytes, 0);
    if (r.status != ffi::AllocStatus::Allocated) {
      fail(std::string(r.message));
      return nullptr;
    }
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(r.ptr));
    auto st = c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(),
        static_cast<int64_t>(nbytes),
        c10::DataPtr(p, p, &gmlake::local_raw_delete, c10::Device(c10::DeviceType::CUDA, 0)),
        nullptr,
        false);
    return st.release();
  } catch (const std::exception& e) {
    fail(e.what());
    return nullptr;
  }
}

// Whether `ptr` is a live allocation of the simulated allocator: 1, 0, or -1.
GMLAKE_EXPORT int gmlake_tier_test_live(uint64_t ptr) {
  try {
    return g_sim != nullptr && g_sim->allocation(ptr).found ? 1 : 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
