// The cxx bridge from C++, over the simulated device: no GPU, no torch. Checks that results,
// out-of-memory outcomes and errors (thrown as rust::Error) arrive as documented.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "rust/cxx.h"
#include "gmlake-ffi/src/lib.rs.h"

namespace ffi = gmlake::ffi;

#include "check.h"

static constexpr uint64_t MiB = 1ull << 20;

// One of gmlake's counters of `s` by name (the statistics' key without "gmlake."); 0 if none.
static uint64_t counter(const ffi::Stats& s, const char* name) {
  for (const auto& c : s.counters) {
    if (std::string(c.name) == name) {
      return c.count;
    }
  }
  return 0;
}

int main() {
  // A bad configuration throws rust::Error naming the key and the value.
  try {
    ffi::check_conf("defragLevel:high");
    CHECK(false, "no exception for an invalid configuration");
  } catch (const rust::Error& e) {
    std::string m = e.what();
    CHECK(m.find("defragLevel") != std::string::npos && m.find("high") != std::string::npos, "%s", m.c_str());
  }

  rust::Box<ffi::Gmlake> a = ffi::new_simulated_allocator(64 * MiB, 0, "");
  CHECK(std::string(a->backend_name()) == "simulated", "backend");

  // Allocate until the device is full, free every other block, then ask for more than any
  // free block: a stitch serves it.
  std::vector<uint64_t> ptrs;
  for (;;) {
    ffi::AllocOutcome r = a->allocate(2 * MiB, 0);
    if (r.status != ffi::AllocStatus::Allocated) {
      CHECK(r.status == ffi::AllocStatus::OutOfMemory, "expected OOM, got %d: %s", static_cast<int>(r.status),
            std::string(r.message).c_str());
      CHECK(r.requested == 2 * MiB, "requested %llu", (unsigned long long)r.requested);
      CHECK(!r.message.empty(), "OOM message");
      break;
    }
    ptrs.push_back(r.ptr);
  }
  CHECK(ptrs.size() >= 8, "only %zu blocks", ptrs.size());
  for (size_t i = 0; i < ptrs.size(); i += 2) {
    CHECK(a->free_ptr(ptrs[i]).status == ffi::FreeStatus::Done, "free");
  }
  ffi::AllocOutcome big = a->allocate(6 * MiB, 0);
  CHECK(big.status == ffi::AllocStatus::Allocated, "stitched allocation failed: %s", std::string(big.message).c_str());
  ffi::Stats s = a->stats();
  CHECK(counter(s, "stitches") >= 1, "no stitch recorded");
  CHECK(s.num_ooms == 1, "num_ooms %lld", (long long)s.num_ooms);
  CHECK(s.allocation[0].current == static_cast<int64_t>(ptrs.size() / 2 + 1), "allocation count");

  // Unknown pointers and double frees are outcomes, not exceptions.
  CHECK(a->free_ptr(0x1234000).status == ffi::FreeStatus::UnknownPointer, "unknown pointer");
  CHECK(a->free_ptr(big.ptr).status == ffi::FreeStatus::Done, "free big");
  CHECK(a->free_ptr(big.ptr).status == ffi::FreeStatus::DoubleFree, "double free");

  // Errors of fallible calls are thrown.
  try {
    a->set_memory_fraction(2.0);
    CHECK(false, "no exception for fraction 2.0");
  } catch (const rust::Error& e) {
    CHECK(std::string(e.what()).find("memory_fraction") != std::string::npos, "%s", e.what());
  }
  try {
    a->add_peer(1);
    CHECK(false, "no exception for a peer of the simulated device");
  } catch (const rust::Error&) {
  }

  std::string json(a->stats_json());
  CHECK(json.find("\"gmlake.stitches\":") != std::string::npos, "stats json: %s", json.c_str());
  ffi::SnapshotRecord snap = a->snapshot();
  CHECK(!snap.segments.empty(), "empty snapshot");

  for (size_t i = 1; i < ptrs.size(); i += 2) {
    a->free_ptr(ptrs[i]);
  }
  a->empty_cache();
  CHECK(a->stats().reserved_bytes[0].current == 0, "reserved after empty_cache");

  {
    // The host tier through the bridge (cpp/tier.cpp's calls): adopt, put over the budget
    // (evicted), get back at a new place, free.
    ffi::TierConf conf;
    conf.has_budget = true;
    conf.budget = 4 * MiB;
    conf.policy = "lru";
    rust::Box<ffi::GmlakeTier> t = a->new_tier(conf);
    ffi::AllocOutcome p = a->allocate(3 * MiB, 0);
    ffi::AllocOutcome q = a->allocate(3 * MiB, 0);
    CHECK(p.status == ffi::AllocStatus::Allocated && q.status == ffi::AllocStatus::Allocated, "tier allocations");
    uint64_t ip = t->adopt(p.ptr, 3 * MiB, 0);
    uint64_t iq = t->adopt(q.ptr, 3 * MiB, 0);
    t->put(ip, 5);
    t->poll();
    CHECK(t->state(ip) == ffi::TierState::Evicted, "put over the budget: evicted (state %d)",
          static_cast<int>(t->state(ip)));
    t->put(iq, -1);
    ffi::TierFetch f = t->get(ip, 0);
    CHECK(!f.hit && f.ptr != 0, "get of an evicted tensor");
    t->verify();
    ffi::TierStatsRecord ts = t->stats();
    CHECK(ts.adopts == 2 && ts.misses == 1 && ts.evictions >= 1, "tier stats");
    CHECK(std::string(ts.policy) == "lru", "tier policy");
    t->free(ip);
    t->free(iq);
    t->flush();
    CHECK(t->stats().device_bytes == 0, "tier device bytes after frees");
    try {
      t->free(ip);
      CHECK(false, "no exception for a tier tensor freed twice");
    } catch (const rust::Error&) {
    }
    conf.policy = "fifo";
    try {
      t->reconfigure(conf);
      CHECK(false, "no exception for an unknown tier policy");
    } catch (const rust::Error& e) {
      CHECK(std::string(e.what()).find("fifo") != std::string::npos, "%s", e.what());
    }
  }

  if (failures == 0) {
    std::printf("gmlake_bridge_test: ok (%zu blocks, %llu stitches)\n", ptrs.size(), (unsigned long long)counter(s, "stitches"));
    return 0;
  }
  std::printf("gmlake_bridge_test: %d failure(s)\n", failures);
  return 1;
}
