// cpp/tier.cpp's ownership rules over a simulated device, without a GPU: loads
// libgmlake_torch.so with dlopen (as Python does) and drives the gmlake_tier_* C functions with
// c10::StorageImpls, as python/gmlake/tier.py does with tensors' storages.
//
// usage: gmlake_tier_test <path to libgmlake_torch.so>
#include <dlfcn.h>

#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "check.h"

namespace {

const uint64_t MiB = 1 << 20;

using sim_fn = int (*)(uint64_t, uint64_t);
using storage_fn = void* (*)(uint64_t);
using live_fn = int (*)(uint64_t);
using put_fn = int64_t (*)(void*, uint64_t, int64_t);
using get_fn = int (*)(int64_t, uint64_t, uint64_t*, uint64_t*, int*);
using bind_fn = int (*)(void*, int64_t);
using handle_fn = int (*)(int64_t);
using dev_fn = int (*)(int);
using flush_fn = int (*)(int, int);
using str_fn = const char* (*)();
using json_fn = long long (*)(int, char*, size_t);
using advance_fn = int (*)(int, uint64_t);

template <typename F>
F sym(void* lib, const char* name) {
  F f = reinterpret_cast<F>(dlsym(lib, name));
  if (f == nullptr) {
    std::fprintf(stderr, "missing symbol %s\n", name);
    std::exit(1);
  }
  return f;
}

// Drops the reference the C function handed over.
void drop(void* st) {
  c10::intrusive_ptr<c10::StorageImpl>::reclaim(static_cast<c10::StorageImpl*>(st));
}

uint64_t data(void* st) {
  return static_cast<uint64_t>(
      reinterpret_cast<uintptr_t>(static_cast<c10::StorageImpl*>(st)->data_ptr().get()));
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <libgmlake_torch.so>\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
    return 1;
  }
  auto simulated = sym<sim_fn>(lib, "gmlake_tier_test_simulated");
  auto storage = sym<storage_fn>(lib, "gmlake_tier_test_storage");
  auto live = sym<live_fn>(lib, "gmlake_tier_test_live");
  auto put = sym<put_fn>(lib, "gmlake_tier_put");
  auto get = sym<get_fn>(lib, "gmlake_tier_get");
  auto bind = sym<bind_fn>(lib, "gmlake_tier_bind");
  auto unget = sym<handle_fn>(lib, "gmlake_tier_unget");
  auto free_h = sym<handle_fn>(lib, "gmlake_tier_free");
  auto state = sym<handle_fn>(lib, "gmlake_tier_state");
  auto verify = sym<dev_fn>(lib, "gmlake_tier_verify");
  auto flush = sym<flush_fn>(lib, "gmlake_tier_flush");
  auto last_error = sym<str_fn>(lib, "gmlake_tier_last_error");
  auto stats = sym<json_fn>(lib, "gmlake_tier_stats_json");
  auto advance = sym<advance_fn>(lib, "gmlake_tier_advance");
  auto stats_str = [&]() {
    char buf[4096];
    stats(0, buf, sizeof(buf));
    return std::string(buf);
  };

  CHECK(simulated(1ull << 30, 4 * MiB) == 0, "%s", last_error());
  CHECK(simulated(1ull << 30, 4 * MiB) == -1, "a second simulated tier");

  // put: the storage stays valid and resident while it lives; put in the tier when it dies.
  void* s1 = storage(3 * MiB);
  CHECK(s1 != nullptr, "%s", last_error());
  const uint64_t p1 = data(s1);
  int64_t h1 = put(s1, 0, 5);
  CHECK(h1 > 0, "put: %s", last_error());
  CHECK(data(s1) == p1, "the storage keeps its memory");
  CHECK(state(h1) == 0, "resident while the storage lives (state %d)", state(h1));
  CHECK(verify(0) == 0, "%s", last_error());
  drop(s1);
  CHECK(state(h1) == 1, "put once the storage died (state %d)", state(h1));
  CHECK(live(p1) == 1, "the tier holds the block");

  // A second tensor over the budget (3 + 3 > 4 MiB): the older put one is evicted (LRU).
  void* s2 = storage(3 * MiB);
  int64_t h2 = put(s2, 0, -1);
  CHECK(h2 > 0 && h2 != h1, "second put: %s", last_error());
  drop(s2);
  flush(0, 0);
  CHECK(state(h1) == 3, "evicted (state %d)", state(h1));
  CHECK(live(p1) == 0, "the evicted block went back to the allocator");
  CHECK(verify(0) == 0, "%s", last_error());

  // get: resident again (anywhere); a storage over the pointer bound to the tier keeps it so.
  uint64_t ptr = 0, nbytes = 0;
  int dev = -1;
  CHECK(get(h1, 0, &ptr, &nbytes, &dev) == 0, "get: %s", last_error());
  CHECK(ptr != 0 && nbytes == 3 * MiB && dev == 0, "get gave %llu bytes at %llx on %d",
        (unsigned long long)nbytes, (unsigned long long)ptr, dev);
  CHECK(state(h1) == 0, "resident after get (state %d)", state(h1));
  auto got = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(),
      static_cast<int64_t>(nbytes),
      c10::DataPtr(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)), c10::Device(c10::DeviceType::CUDA, 0)),
      nullptr,
      false);
  CHECK(bind(got.get(), h1) == 0, "bind: %s", last_error());
  CHECK(bind(got.get(), h1) == -1, "a storage bound twice");
  // The got storage handed to the tier again: another handle on the same tensor.
  int64_t h3 = put(got.get(), 0, 2);
  CHECK(h3 > 0 && h3 != h1, "put of a tier storage: %s", last_error());
  got.reset();
  CHECK(state(h1) == 1 && state(h3) == 1, "put again when the got storage died (%d %d)", state(h1),
        state(h3));
  CHECK(free_h(h1) == 0, "free h1: %s", last_error());
  CHECK(state(h3) == 1, "still held by h3 (state %d)", state(h3));
  CHECK(free_h(h1) == -1 && std::string(last_error()).find("unknown handle") != std::string::npos,
        "free twice: %s", last_error());

  // get then unget (no storage could be made): put again.
  CHECK(get(h3, 0, &ptr, &nbytes, &dev) == 0, "get h3: %s", last_error());
  CHECK(unget(h3) == 0, "unget: %s", last_error());
  CHECK(state(h3) == 1, "put after unget (state %d)", state(h3));
  CHECK(free_h(h3) == 0, "free h3: %s", last_error());
  CHECK(state(h3) == -1, "freed");
  CHECK(free_h(h2) == 0, "free h2: %s", last_error());
  flush(0, 1);
  CHECK(verify(0) == 0, "%s", last_error());
  std::string js = stats_str();
  CHECK(js.find("\"tensors\":0") != std::string::npos && js.find("\"handles\":0") != std::string::npos &&
            js.find("\"device_bytes\":0") != std::string::npos,
        "everything freed: %s", js.c_str());
  CHECK(js.find("\"adopts\":2") != std::string::npos, "two adoptions: %s", js.c_str());

  // Re-declaring a next use: a tensor got from the tier is put again with a later next use and
  // its old handle freed; the later one holds (the old one, 5, would be prefetched at 10).
  {
    void* s6 = storage(3 * MiB);
    int64_t h6 = put(s6, 0, 5);
    CHECK(h6 > 0, "put: %s", last_error());
    drop(s6);
    void* s7 = storage(3 * MiB);
    int64_t h7 = put(s7, 0, -1);
    drop(s7);
    flush(0, 0);
    CHECK(state(h6) == 3, "evicted for the second tensor (state %d)", state(h6));
    CHECK(get(h6, 0, &ptr, &nbytes, &dev) == 0, "get h6: %s", last_error());
    auto got6 = c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(),
        static_cast<int64_t>(nbytes),
        c10::DataPtr(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)), c10::Device(c10::DeviceType::CUDA, 0)),
        nullptr,
        false);
    CHECK(bind(got6.get(), h6) == 0, "bind: %s", last_error());
    int64_t h8 = put(got6.get(), 0, 1000);
    CHECK(h8 > 0, "put again: %s", last_error());
    CHECK(free_h(h6) == 0, "free the old handle: %s", last_error());
    got6.reset();
    CHECK(state(h8) == 1, "put (state %d)", state(h8));
    // Evict it again (h7 fetched over the budget), then make room.
    CHECK(get(h7, 0, &ptr, &nbytes, &dev) == 0, "get h7: %s", last_error());
    CHECK(unget(h7) == 0, "unget h7: %s", last_error());
    flush(0, 0);
    CHECK(state(h8) == 3, "evicted again (state %d)", state(h8));
    CHECK(free_h(h7) == 0, "free h7: %s", last_error());
    flush(0, 0);
    CHECK(advance(0, 10) == 0, "advance: %s", last_error());
    flush(0, 0);
    CHECK(state(h8) == 3, "not prefetched at 10: its next use is 1000 (state %d)", state(h8));
    CHECK(advance(0, 999) == 0, "advance: %s", last_error());
    flush(0, 0);
    CHECK(state(h8) == 1, "prefetched ahead of 1000 (state %d)", state(h8));
    CHECK(free_h(h8) == 0, "free h8: %s", last_error());
    flush(0, 1);
    CHECK(verify(0) == 0, "%s", last_error());
  }

  // Memory gmlake did not allocate is refused, naming why; the storage is left as it was.
  static char host[4096];
  auto foreign = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(),
      static_cast<int64_t>(sizeof(host)),
      c10::DataPtr(host, c10::Device(c10::DeviceType::CUDA, 0)),
      nullptr,
      false);
  CHECK(put(foreign.get(), 0, -1) == -1, "foreign memory accepted");
  CHECK(std::string(last_error()).find("not allocated by gmlake") != std::string::npos, "%s", last_error());
  // A storage whose allocation the tier refuses keeps gmlake's deleter.
  void* s4 = storage(MiB);
  void* s5 = storage(MiB);
  auto* st5 = static_cast<c10::StorageImpl*>(s5);
  // Make s5's pointer not an allocation start: shift the DataPtr by 512 bytes.
  void* shifted = static_cast<char*>(st5->data_ptr().get()) + 512;
  c10::DataPtr old5 = st5->set_data_ptr(c10::DataPtr(
      shifted, st5->data_ptr().get(), st5->data_ptr().get_deleter(), c10::Device(c10::DeviceType::CUDA, 0)));
  (void)old5.release_context();
  CHECK(put(s5, 0, -1) == -1, "a pointer inside an allocation accepted");
  CHECK(std::string(last_error()).find("gmlake.tier.put") != std::string::npos, "%s", last_error());
  CHECK(st5->data_ptr().get() == shifted, "the refused storage kept its memory");
  drop(s4);
  drop(s5);
  CHECK(verify(0) == 0, "%s", last_error());

  if (failures == 0) {
    std::printf("gmlake_tier_test: ok\n");
    return 0;
  }
  std::printf("gmlake_tier_test: %d failure(s)\n", failures);
  return 1;
}
