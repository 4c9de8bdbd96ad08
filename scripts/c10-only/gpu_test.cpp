// The in-tree route on a GPU: exercises the CUDA allocator of a patched libc10_cuda (gmlake built
// in, patches/pytorch-<version>.patch) through PyTorch's own C++ API of that version, linked
// only against the build's libc10.so / libc10_cuda.so and the CUDA runtime it was built with.
// Built and staged by scripts/build-patched-c10.sh; run on the GPU by scripts/c10-gpu-test.sh.
//
//   gpu_test [--expect gmlake|native|cudaMallocAsync]
//
// The backend is chosen by the library when it loads (2.x) or at the first allocator call
// (1.13), from the environment: vmmDefragment=0 -> native, PYTORCH_CUDA_ALLOC_CONF=backend:X
// (2.x). Without --expect the expected backend is derived from the same variables.
//
// Stages (every measured value is printed; a failed check prints a FAIL line and the program
// goes on with the next stage; gmlake-only checks print "skip" under another backend):
//   backend      gmlake_c10_backend() (and CUDAAllocator::name() on 2.x) names the expected one
//   sizes        raw_alloc of 1 B .. 1 GiB, all alive at once: aligned, disjoint, data written
//                (cudaMemset + cudaMemcpy) and read back intact; DataPtrs from get()->allocate;
//                getDeviceStats: allocated grows by at least the bytes asked for, back on free
//   snapshot     snapshot() (c10's SegmentInfo / BlockInfo): every live pointer lies in an
//                allocated block of a segment
//   stitch       (gmlake) fragment: blocks of 4 pages, every other one freed, then one block of
//                3x that size: gmlake.stitches grows, reserved does not, the stitched block and
//                the blocks still alive keep their data, snapshot covers the stitched block
//   record_stream a block used on a second stream (after long work there), recordStream, freed,
//                a block of the same size allocated and written on the default stream: the late
//                write on the second stream must not land in it
//   empty_cache  with cached free memory, emptyCache() lowers reserved
//   oom          setMemoryFraction caps the device; a larger request raises
//                c10::OutOfMemoryError; num_ooms grows; a smaller allocation then works; with
//                the fraction back at 1 a large one works
// Exit status: 0 all passed, 1 a check failed, 2 no usable GPU (or bad arguments).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// GMLAKE_TEST_TORCH_NUM: the torch version as MAJOR * 100 + MINOR (113, 200, 201, 206).
#ifndef GMLAKE_TEST_TORCH_NUM
#error "define GMLAKE_TEST_TORCH_NUM (e.g. 206 for torch 2.6)"
#endif
#if GMLAKE_TEST_TORCH_NUM < 200
#define GMLAKE_TEST_TORCH1 1 // free functions, no allocator class
#endif
#ifndef GMLAKE_TEST_TORCH_VERSION
#define GMLAKE_TEST_TORCH_VERSION "unknown"
#endif

extern "C" const char* gmlake_c10_backend(void);
extern "C" const char* gmlake_c10_stats_json(int device);

namespace cca = c10::cuda::CUDACachingAllocator;

#if GMLAKE_TEST_TORCH_NUM >= 201
// c10 asks "does device N have a primary context?" (MaybeSetDevice, e.g. when the stream pools
// are set up) through a hook that libtorch_cuda fills in; c10 alone has a stub that throws
// "Should never been called". This program plays libtorch_cuda's part (see main).
namespace c10 {
namespace cuda {
namespace _internal {
C10_CUDA_API void setHasPrimaryContext(bool (*func)(c10::DeviceIndex));
} // namespace _internal
} // namespace cuda
} // namespace c10
#endif

namespace {

constexpr size_t KiB = 1024;
constexpr size_t MiB = 1024 * KiB;
constexpr size_t GiB = 1024 * MiB;

int g_checks = 0;
int g_failed = 0;
int g_skipped = 0;
std::vector<std::string> g_failures;
std::string g_stage;

void check(bool ok, const std::string& what, const std::string& values = "") {
  ++g_checks;
  if (!ok) {
    ++g_failed;
    g_failures.push_back(g_stage + ": " + what);
  }
  std::printf("  %s %s%s%s\n", ok ? "ok  " : "FAIL", what.c_str(), values.empty() ? "" : ": ", values.c_str());
  std::fflush(stdout);
}

void skip(const std::string& what, const std::string& why) {
  ++g_skipped;
  std::printf("  skip %s (%s)\n", what.c_str(), why.c_str());
  std::fflush(stdout);
}

void info(const std::string& line) {
  std::printf("  .    %s\n", line.c_str());
  std::fflush(stdout);
}

std::string fmt_bytes(long long b) {
  char buf[64];
  const double a = static_cast<double>(b < 0 ? -b : b);
  if (a >= GiB) {
    std::snprintf(buf, sizeof buf, "%lld (%.2f GiB)", b, b / static_cast<double>(GiB));
  } else if (a >= MiB) {
    std::snprintf(buf, sizeof buf, "%lld (%.2f MiB)", b, b / static_cast<double>(MiB));
  } else {
    std::snprintf(buf, sizeof buf, "%lld", b);
  }
  return buf;
}

template <class... Args>
std::string strf(const char* f, Args... args) {
  char buf[1024];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

// A CUDA runtime call that must succeed (throws to end the stage otherwise).
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }
}
#define CUDA_OK(expr) cuda_ok((expr), #expr)

std::string lower(std::string s) {
  for (auto& c : s) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return s;
}

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

// ---- the allocator, through the version's API

#ifdef GMLAKE_TEST_TORCH1
using Stats = cca::DeviceStats;
std::string allocator_name() {
  return gmlake_c10_backend();
}
Stats device_stats() {
  return cca::getDeviceStats(0);
}
std::vector<cca::SegmentInfo> segments() {
  return cca::snapshot();
}
void set_fraction(double f) {
  cca::setMemoryFraction(f, 0);
}
#else
using Stats = decltype(cca::getDeviceStats(0));
std::string allocator_name() {
  return cca::get()->name();
}
Stats device_stats() {
  return cca::getDeviceStats(0);
}
std::vector<cca::SegmentInfo> segments() {
  return cca::snapshot().segments;
}
void set_fraction(double f) {
  cca::setMemoryFraction(f, 0);
}
#endif

std::string stats_line(const Stats& s) {
  return strf("allocated=%s reserved=%s active=%s allocations=%lld segments=%lld num_ooms=%lld num_alloc_retries=%lld",
      fmt_bytes(s.allocated_bytes[0].current).c_str(), fmt_bytes(s.reserved_bytes[0].current).c_str(),
      fmt_bytes(s.active_bytes[0].current).c_str(), static_cast<long long>(s.allocation[0].current),
      static_cast<long long>(s.segment[0].current), static_cast<long long>(s.num_ooms),
      static_cast<long long>(s.num_alloc_retries));
}

// A number of gmlake_c10_stats_json's flat object; -1 when absent.
double json_num(const std::string& json, const std::string& key) {
  const std::string k = "\"" + key + "\"";
  size_t at = json.find(k);
  if (at == std::string::npos) {
    return -1;
  }
  at += k.size();
  while (at < json.size() && (json[at] == ' ' || json[at] == ':')) {
    ++at;
  }
  return std::strtod(json.c_str() + at, nullptr);
}

std::string gmlake_json() {
  const char* j = gmlake_c10_stats_json(0);
  return j != nullptr ? std::string(j) : std::string();
}

// ---- data

uint8_t pattern_byte(uint64_t seed, size_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

// Writes a recognisable content into [p, p + n): the whole range set to fill(seed) with
// cudaMemset, then pattern bytes copied into the first and last (up to) 1 MiB.
uint8_t fill_of(uint64_t seed) {
  return static_cast<uint8_t>(0x11 + (seed * 37) % 200);
}

void write_data(void* p, size_t n, uint64_t seed) {
  CUDA_OK(cudaMemset(p, fill_of(seed), n));
  const size_t chunk = std::min(n, MiB);
  std::vector<uint8_t> h(chunk);
  for (size_t i = 0; i < chunk; ++i) {
    h[i] = pattern_byte(seed, i);
  }
  CUDA_OK(cudaMemcpy(p, h.data(), chunk, cudaMemcpyHostToDevice));
  if (n > 2 * chunk) {
    for (size_t i = 0; i < chunk; ++i) {
      h[i] = pattern_byte(seed + 1000003, i);
    }
    CUDA_OK(cudaMemcpy(static_cast<char*>(p) + n - chunk, h.data(), chunk, cudaMemcpyHostToDevice));
  }
}

// Reads back what write_data wrote: head, tail and a middle sample. "" when intact.
std::string verify_data(const void* p, size_t n, uint64_t seed) {
  const size_t chunk = std::min(n, MiB);
  std::vector<uint8_t> h(chunk);
  CUDA_OK(cudaMemcpy(h.data(), p, chunk, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < chunk; ++i) {
    if (h[i] != pattern_byte(seed, i)) {
      return strf("head byte %zu is 0x%02x, wrote 0x%02x", i, h[i], pattern_byte(seed, i));
    }
  }
  if (n > 2 * chunk) {
    CUDA_OK(cudaMemcpy(h.data(), static_cast<const char*>(p) + n - chunk, chunk, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < chunk; ++i) {
      if (h[i] != pattern_byte(seed + 1000003, i)) {
        return strf("tail byte %zu is 0x%02x", n - chunk + i, h[i]);
      }
    }
    const size_t mid = std::min<size_t>(n - 2 * chunk, 64 * KiB);
    std::vector<uint8_t> m(mid);
    const size_t off = chunk + (n - 2 * chunk - mid) / 2;
    CUDA_OK(cudaMemcpy(m.data(), static_cast<const char*>(p) + off, mid, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < mid; ++i) {
      if (m[i] != fill_of(seed)) {
        return strf("middle byte %zu is 0x%02x, set 0x%02x", off + i, m[i], fill_of(seed));
      }
    }
  } else if (n > chunk) {
    // (n <= 2 MiB: the bytes after the head hold the fill.)
    std::vector<uint8_t> m(n - chunk);
    CUDA_OK(cudaMemcpy(m.data(), static_cast<const char*>(p) + chunk, n - chunk, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < m.size(); ++i) {
      if (m[i] != fill_of(seed)) {
        return strf("byte %zu is 0x%02x, set 0x%02x", chunk + i, m[i], fill_of(seed));
      }
    }
  }
  return "";
}

// Every live (pointer, size) lies in an allocated block of some segment of snapshot().
void check_snapshot(const std::vector<std::pair<void*, size_t>>& live, const char* when) {
  const auto segs = segments();
  long long total = 0;
  long long allocated = 0;
  size_t blocks = 0;
  for (const auto& s : segs) {
    total += static_cast<long long>(s.total_size);
    allocated += static_cast<long long>(s.allocated_size);
    blocks += s.blocks.size();
  }
  const Stats st = device_stats();
  info(strf("snapshot (%s): %zu segments, %zu blocks, sum(total_size)=%s sum(allocated_size)=%s; stats: reserved=%s allocated=%s",
      when, segs.size(), blocks, fmt_bytes(total).c_str(), fmt_bytes(allocated).c_str(),
      fmt_bytes(st.reserved_bytes[0].current).c_str(), fmt_bytes(st.allocated_bytes[0].current).c_str()));
  size_t found = 0;
  std::string missing;
  for (const auto& l : live) {
    const uint64_t p = reinterpret_cast<uint64_t>(l.first);
    bool in = false;
    for (const auto& s : segs) {
      const uint64_t base = static_cast<uint64_t>(s.address);
      if (p < base || p >= base + static_cast<uint64_t>(s.total_size)) {
        continue;
      }
      uint64_t at = base;
      for (const auto& b : s.blocks) {
        const uint64_t sz = static_cast<uint64_t>(b.size);
        if (p >= at && p + l.second <= at + sz && b.allocated) {
          in = true;
          break;
        }
        at += sz;
      }
      if (in) {
        break;
      }
    }
    if (in) {
      ++found;
    } else if (missing.size() < 200) {
      missing += strf(" %p(+%zu)", l.first, l.second);
    }
  }
  check(found == live.size(), strf("snapshot (%s): every live pointer is in an allocated block", when),
      strf("%zu of %zu found%s%s", found, live.size(), missing.empty() ? "" : "; not found:", missing.c_str()));
  check(allocated <= total, strf("snapshot (%s): sum(allocated_size) <= sum(total_size)", when));
}

std::string expected_backend(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--expect" && i + 1 < argc) {
      return argv[i + 1];
    }
    if (a.rfind("--expect=", 0) == 0) {
      return a.substr(9);
    }
  }
#ifndef GMLAKE_TEST_TORCH1
  if (const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF")) {
    const std::string c = conf;
    const size_t at = c.find("backend:");
    if (at != std::string::npos) {
      std::string v = c.substr(at + 8);
      v = v.substr(0, v.find(','));
      while (!v.empty() && v.back() == ' ') {
        v.pop_back();
      }
      return v;
    }
  }
#endif
  if (const char* v = std::getenv("vmmDefragment")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*v != '\0' && end != v && end != nullptr && *end == '\0' && n <= 0) {
      return "native";
    }
  }
  return "gmlake";
}

void run_stage(const char* name, const std::function<void()>& body) {
  g_stage = name;
  std::printf("[%s]\n", name);
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    body();
  } catch (const c10::Error& e) {
    check(false, std::string("no exception escapes the stage"), std::string("c10::Error: ") + first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    check(false, std::string("no exception escapes the stage"), e.what());
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  (%s: %.1f ms)\n", name, ms);
  std::fflush(stdout);
}

} // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: %s [--expect gmlake|native|cudaMallocAsync]\n", argv[0]);
      return 0;
    }
  }
  const std::string expect = expected_backend(argc, argv);
  const char* vmm = std::getenv("vmmDefragment");
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  std::printf("gpu_test: patched torch %s c10/c10_cuda; vmmDefragment=%s PYTORCH_CUDA_ALLOC_CONF=%s; expected backend: %s\n",
      GMLAKE_TEST_TORCH_VERSION, vmm ? vmm : "(unset)", conf ? conf : "(unset)", expect.c_str());

  int rt = 0;
  int drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  int ndev = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  std::printf("CUDA runtime %d.%d, driver supports CUDA %d.%d (0.0: unknown, no driver)\n", rt / 1000, (rt % 1000) / 10, drv / 1000,
      (drv % 1000) / 10);
  if (e != cudaSuccess || ndev == 0) {
    std::printf("FAIL: no usable CUDA device: cudaGetDeviceCount: %s%s%s (this test needs a GPU; backend in the library: %s)\n",
        e != cudaSuccess ? cudaGetErrorName(e) : "0 devices", e != cudaSuccess ? ": " : "",
        e != cudaSuccess ? cudaGetErrorString(e) : "", gmlake_c10_backend());
    return 2;
  }
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cuda_ok(cudaSetDevice(0), "cudaSetDevice(0)");
  size_t dev_free = 0;
  size_t dev_total = 0;
  cuda_ok(cudaMemGetInfo(&dev_free, &dev_total), "cudaMemGetInfo");
  std::printf("device 0 of %d: %s, sm_%d%d, total %s, free %s\n", ndev, prop.name, prop.major, prop.minor,
      fmt_bytes(static_cast<long long>(dev_total)).c_str(), fmt_bytes(static_cast<long long>(dev_free)).c_str());

#if GMLAKE_TEST_TORCH_NUM >= 201
  // Device 0's primary context exists (cudaSetDevice + cudaMemGetInfo above made it); no other
  // device is touched.
  c10::cuda::_internal::setHasPrimaryContext([](c10::DeviceIndex d) { return d == 0; });
#endif
  // As torch's lazy CUDA init does.
  cca::init(ndev);
  const std::string backend = gmlake_c10_backend();
  const bool gm = backend == "gmlake";

  run_stage("backend", [&] {
    const std::string name = allocator_name();
    check(backend == expect, "gmlake_c10_backend() names the expected allocator", "\"" + backend + "\", expected \"" + expect + "\"");
#ifndef GMLAKE_TEST_TORCH1
    check(name == expect, "CUDAAllocator::name() (get()) names the expected allocator", "\"" + name + "\"");
#if GMLAKE_TEST_TORCH_NUM >= 206
    info(strf("initialized()=%d getMemoryFraction(0)=%g", cca::get()->initialized() ? 1 : 0, cca::getMemoryFraction(0)));
#else
    info(strf("initialized()=%d", cca::get()->initialized() ? 1 : 0));
#endif
#endif
    const std::string j = gmlake_json();
    if (gm) {
      check(j.find("error") == std::string::npos, "gmlake_c10_stats_json(0) answers", j.substr(0, 160) + (j.size() > 160 ? "..." : ""));
    } else {
      check(j == "{}", "gmlake_c10_stats_json(0) is {} under another allocator", j);
    }
  });

  run_stage("sizes", [&] {
    const Stats before = device_stats();
    info("before: " + stats_line(before));
    void* z = cca::raw_alloc(0);
    check(z == nullptr, "raw_alloc(0) returns nullptr (as PyTorch's allocator)", strf("%p", z));
    cca::raw_delete(z);
    const std::vector<size_t> sizes = {1, 3, 512, 513, 4096, 65536, MiB - 1, MiB, MiB + 1, 2 * MiB, 2 * MiB + 1,
        3 * MiB + 5, 8 * MiB, 10 * MiB, 10 * MiB + 1, 20 * MiB + 7, 64 * MiB, 100 * MiB + 3, 256 * MiB, GiB + 1};
    std::vector<std::pair<void*, size_t>> live;
    std::vector<uint64_t> seeds;
    std::vector<void*> raw;
    size_t asked = 0;
    size_t min_align = 1 << 20;
    for (size_t i = 0; i < sizes.size(); ++i) {
      void* p = cca::raw_alloc(sizes[i]);
      if (p == nullptr) {
        check(false, strf("raw_alloc(%zu) returns a pointer", sizes[i]));
        continue;
      }
      const uint64_t a = reinterpret_cast<uint64_t>(p);
      min_align = std::min<size_t>(min_align, static_cast<size_t>(a & (~a + 1)));
      live.emplace_back(p, sizes[i]);
      seeds.push_back(i);
      raw.push_back(p);
      asked += sizes[i];
      write_data(p, sizes[i], i);
    }
    // Two more through the c10::Allocator interface (DataPtr), and one on another stream.
    auto s2 = c10::cuda::getStreamFromPool(false, 0);
    void* ps = cca::raw_alloc_with_stream(5 * MiB + 11, s2.stream());
    check(ps != nullptr, "raw_alloc_with_stream(5 MiB + 11, a pool stream) returns a pointer");
    if (ps != nullptr) {
      live.emplace_back(ps, 5 * MiB + 11);
      seeds.push_back(100);
      asked += 5 * MiB + 11;
      write_data(ps, 5 * MiB + 11, 100);
    }
    c10::DataPtr d1 = cca::get()->allocate(777);
    c10::DataPtr d2 = cca::get()->allocate(33 * MiB);
    check(d1.get() != nullptr && d2.get() != nullptr && d1.device().is_cuda() && d1.device().index() == 0,
        "get()->allocate() returns DataPtrs on cuda:0", strf("%p %p device=%s", d1.get(), d2.get(), d1.device().str().c_str()));
    live.emplace_back(d1.get(), 777);
    live.emplace_back(d2.get(), 33 * MiB);
    seeds.push_back(101);
    seeds.push_back(102);
    asked += 777 + 33 * MiB;
    write_data(d1.get(), 777, 101);
    write_data(d2.get(), 33 * MiB, 102);
    CUDA_OK(cudaDeviceSynchronize());
    check(min_align >= 256, "every pointer is at least 256-byte aligned (cudaMalloc's guarantee)", strf("smallest alignment %zu", min_align));
    auto sorted = live;
    std::sort(sorted.begin(), sorted.end());
    size_t overlaps = 0;
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (static_cast<char*>(sorted[i - 1].first) + sorted[i - 1].second > sorted[i].first) {
        ++overlaps;
      }
    }
    check(overlaps == 0, strf("the %zu live allocations are disjoint", live.size()), strf("%zu overlaps", overlaps));
    size_t bad = 0;
    std::string first_bad;
    for (size_t i = 0; i < live.size(); ++i) {
      const std::string r = verify_data(live[i].first, live[i].second, seeds[i]);
      if (!r.empty()) {
        if (bad++ == 0) {
          first_bad = strf("size %zu at %p: ", live[i].second, live[i].first) + r;
        }
      }
    }
    check(bad == 0, strf("data written to all %zu allocations reads back intact (cudaMemset + cudaMemcpy)", live.size()),
        bad == 0 ? strf("%s bytes asked for in all", fmt_bytes(static_cast<long long>(asked)).c_str()) : strf("%zu bad; first: %s", bad, first_bad.c_str()));
    const Stats during = device_stats();
    info("with all alive: " + stats_line(during));
    const long long grew = during.allocated_bytes[0].current - before.allocated_bytes[0].current;
    check(grew >= static_cast<long long>(asked), "getDeviceStats: allocated_bytes grew by at least the bytes asked for",
        strf("grew %s, asked %s", fmt_bytes(grew).c_str(), fmt_bytes(static_cast<long long>(asked)).c_str()));
    check(during.reserved_bytes[0].current >= during.allocated_bytes[0].current, "getDeviceStats: reserved >= allocated");
    const long long count = during.allocation[0].current - before.allocation[0].current;
    check(count >= static_cast<long long>(live.size()), "getDeviceStats: allocation count grew by at least the live allocations",
        strf("grew %lld, %zu live", count, live.size()));
    check_snapshot(live, "sizes");
    for (void* p : raw) {
      cca::raw_delete(p);
    }
    if (ps != nullptr) {
      cca::raw_delete(ps);
    }
    d1.clear();
    d2.clear();
    CUDA_OK(cudaDeviceSynchronize());
    const Stats after = device_stats();
    info("after freeing: " + stats_line(after));
    check(after.allocated_bytes[0].current == before.allocated_bytes[0].current, "getDeviceStats: allocated_bytes back where it was",
        strf("%s, before %s", fmt_bytes(after.allocated_bytes[0].current).c_str(), fmt_bytes(before.allocated_bytes[0].current).c_str()));
  });

  run_stage("stitch", [&] {
    cca::emptyCache();
    std::string j = gmlake_json();
    double page = gm ? json_num(j, "gmlake.page_size") : -1;
    if (page <= 0) {
      page = 2.0 * MiB;
    }
    const size_t block = 4 * static_cast<size_t>(page);
    // 17 blocks: the last one stays alive, so no free block ends the mapped range (growing it
    // in place would be new memory, not a stitch).
    const int n = 17;
    std::vector<void*> blocks(n, nullptr);
    for (int i = 0; i < n; ++i) {
      blocks[i] = cca::raw_alloc(block);
      write_data(blocks[i], block, 200 + i);
    }
    for (int i = 1; i < n; i += 2) {
      cca::raw_delete(blocks[i]);
      blocks[i] = nullptr;
    }
    CUDA_OK(cudaDeviceSynchronize());
    j = gmlake_json();
    const Stats s0 = device_stats();
    const double st0 = json_num(j, "gmlake.stitches");
    const double pg0 = json_num(j, "gmlake.pages_stitched");
    info(strf("%d blocks of %s, every other one freed: ", n, fmt_bytes(static_cast<long long>(block)).c_str()) + stats_line(s0));
    if (gm) {
      info(strf("gmlake: page_size=%s stitches=%.0f pages_stitched=%.0f cached_bytes=%s", fmt_bytes(static_cast<long long>(page)).c_str(), st0, pg0,
          fmt_bytes(static_cast<long long>(json_num(j, "gmlake.cached_bytes"))).c_str()));
    }
    // (A non-zero start: with 0, cacheInfo starts from a guess of what the device has free.)
    size_t largest = 1;
#ifdef GMLAKE_TEST_TORCH1
    size_t cached_free = 0;
    cca::cacheInfo(0, &cached_free, &largest);
    info(strf("cacheInfo: largest free block %s, cached and free %s", fmt_bytes(static_cast<long long>(largest)).c_str(),
        fmt_bytes(static_cast<long long>(cached_free)).c_str()));
#else
    cca::cacheInfo(0, &largest);
    info(strf("cacheInfo: largest free block %s", fmt_bytes(static_cast<long long>(largest)).c_str()));
#endif
    const size_t big = 3 * block;
    void* s = cca::raw_alloc(big);
    write_data(s, big, 300);
    CUDA_OK(cudaDeviceSynchronize());
    j = gmlake_json();
    const Stats s1 = device_stats();
    const double st1 = json_num(j, "gmlake.stitches");
    const double pg1 = json_num(j, "gmlake.pages_stitched");
    info(strf("then one block of %s (%p): ", fmt_bytes(static_cast<long long>(big)).c_str(), s) + stats_line(s1));
    if (gm) {
      info(strf("gmlake: stitches %.0f -> %.0f, pages_stitched %.0f -> %.0f", st0, st1, pg0, pg1));
      info(strf("largest cached free block %s, request %s%s", fmt_bytes(static_cast<long long>(largest)).c_str(),
          fmt_bytes(static_cast<long long>(big)).c_str(), largest < big ? "" : " (a free block was large enough: no stitch needed)"));
      check(st0 >= 0 && st1 > st0, "the request was stitched: gmlake.stitches grew", strf("%.0f -> %.0f", st0, st1));
      check(pg1 > pg0, "gmlake.pages_stitched grew", strf("%.0f -> %.0f", pg0, pg1));
      check(s1.reserved_bytes[0].current <= s0.reserved_bytes[0].current, "reserved did not grow (the stitch reused cached pages)",
          strf("%s -> %s", fmt_bytes(s0.reserved_bytes[0].current).c_str(), fmt_bytes(s1.reserved_bytes[0].current).c_str()));
    } else {
      skip("stitch counters and reserved-not-growing", "backend " + backend + " does not stitch; reserved " +
          fmt_bytes(s0.reserved_bytes[0].current) + " -> " + fmt_bytes(s1.reserved_bytes[0].current));
    }
    std::string r = verify_data(s, big, 300);
    check(r.empty(), "the large block's data reads back intact", r);
    size_t bad = 0;
    std::vector<std::pair<void*, size_t>> live{{s, big}};
    for (int i = 0; i < n; i += 2) {
      live.emplace_back(blocks[i], block);
      if (!verify_data(blocks[i], block, 200 + i).empty()) {
        ++bad;
      }
    }
    check(bad == 0, "the blocks still alive kept their data", strf("%zu of %d damaged", bad, (n + 1) / 2));
    check_snapshot(live, "stitch");
    // Once more after freeing it: a stitched block may be reused whole.
    cca::raw_delete(s);
    void* s2 = cca::raw_alloc(big);
    write_data(s2, big, 301);
    r = verify_data(s2, big, 301);
    check(r.empty(), "a second block of that size (after freeing the first) reads back intact", r);
    j = gmlake_json();
    const Stats s3 = device_stats();
    info(strf("second large block %p: ", s2) + stats_line(s3));
    if (gm) {
      info(strf("gmlake: stitches=%.0f stitch_reuses=%.0f pages_stitched=%.0f", json_num(j, "gmlake.stitches"),
          json_num(j, "gmlake.stitch_reuses"), json_num(j, "gmlake.pages_stitched")));
    }
    cca::raw_delete(s2);
    for (void* p : blocks) {
      if (p != nullptr) {
        cca::raw_delete(p);
      }
    }
    CUDA_OK(cudaDeviceSynchronize());
    cca::emptyCache();
    info("after freeing and emptyCache: " + stats_line(device_stats()));
  });

  run_stage("record_stream", [&] {
    auto s2 = c10::cuda::getStreamFromPool(false, 0);
    const size_t n = 8 * MiB;
    // Long work on s2: a 512 MiB buffer set 40 times (several ms on an H100).
    const size_t busy_n = 512 * MiB;
    void* busy = cca::raw_alloc_with_stream(busy_n, s2.stream());
    auto run_case = [&](bool record) {
      c10::DataPtr p = cca::get()->allocate(n);
      void* old = p.get();
      CUDA_OK(cudaMemset(old, 0x00, n));
      CUDA_OK(cudaDeviceSynchronize());
      for (int i = 0; i < 40; ++i) {
        CUDA_OK(cudaMemsetAsync(busy, i, busy_n, s2.stream()));
      }
      // The late write on s2 into p.
      CUDA_OK(cudaMemsetAsync(old, 0xA5, n, s2.stream()));
      if (record) {
        cca::recordStream(p, s2);
      }
      p.clear();
      const cudaError_t pending = cudaStreamQuery(s2.stream());
      (void)cudaGetLastError(); // (cudaErrorNotReady is not an error here)
      c10::DataPtr q = cca::get()->allocate(n);
      CUDA_OK(cudaMemset(q.get(), 0x11, n));
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint8_t> h(n);
      CUDA_OK(cudaMemcpy(h.data(), q.get(), n, cudaMemcpyDeviceToHost));
      const size_t wrong = static_cast<size_t>(std::count_if(h.begin(), h.end(), [](uint8_t b) { return b != 0x11; }));
      const std::string v = strf("freed %p, next block %p (%s), s2 %s at the free; %zu of %zu bytes not 0x11", old, q.get(),
          q.get() == old ? "same address" : "another address", pending == cudaErrorNotReady ? "still busy" : "already idle", wrong, n);
      if (record) {
        check(wrong == 0, "recordStream: a block freed while a second stream still uses it is not handed out under that use", v);
      } else {
        (void)cudaGetLastError();
        info("without recordStream (no check; shows what recordStream prevents): " + v);
      }
    };
    run_case(true);
    run_case(false);
    cca::raw_delete(busy);
    CUDA_OK(cudaDeviceSynchronize());
  });

  run_stage("empty_cache", [&] {
    std::vector<void*> ps;
    for (int i = 0; i < 6; ++i) {
      ps.push_back(cca::raw_alloc(48 * MiB + i * MiB));
    }
    void* keep = cca::raw_alloc(3 * MiB);
    for (void* p : ps) {
      cca::raw_delete(p);
    }
    CUDA_OK(cudaDeviceSynchronize());
    const Stats b = device_stats();
    info("6 blocks of ~48 MiB freed, 3 MiB kept: " + stats_line(b));
    cca::emptyCache();
    const Stats a = device_stats();
    info("after emptyCache(): " + stats_line(a));
    check(b.reserved_bytes[0].current > b.allocated_bytes[0].current, "there was cached free memory before emptyCache",
        strf("reserved %s > allocated %s", fmt_bytes(b.reserved_bytes[0].current).c_str(), fmt_bytes(b.allocated_bytes[0].current).c_str()));
    check(a.reserved_bytes[0].current < b.reserved_bytes[0].current, "emptyCache() lowered reserved",
        strf("%s -> %s", fmt_bytes(b.reserved_bytes[0].current).c_str(), fmt_bytes(a.reserved_bytes[0].current).c_str()));
    check(a.allocated_bytes[0].current == b.allocated_bytes[0].current, "emptyCache() left allocated as it was");
    check(a.reserved_bytes[0].current >= a.allocated_bytes[0].current, "reserved >= allocated after emptyCache");
    const std::string r = (write_data(keep, 3 * MiB, 400), verify_data(keep, 3 * MiB, 400));
    check(r.empty(), "the block kept across emptyCache is usable", r);
    cca::raw_delete(keep);
    cca::emptyCache();
  });

  run_stage("oom", [&] {
    cca::emptyCache();
    const size_t limit = 2 * GiB;
    const double fraction = static_cast<double>(limit) / static_cast<double>(dev_total);
    const Stats b = device_stats();
    set_fraction(fraction);
    info(strf("setMemoryFraction(%.5f, 0): a cap of %s; ", fraction, fmt_bytes(static_cast<long long>(limit)).c_str()) + stats_line(b));
    bool oom = false;
    try {
      void* p = cca::raw_alloc(4 * GiB);
      check(false, "raw_alloc(4 GiB) over a 2 GiB cap raises c10::OutOfMemoryError", strf("returned %p", p));
      cca::raw_delete(p);
    } catch (const c10::OutOfMemoryError& e) {
      oom = true;
      const std::string msg = first_line(e.what_without_backtrace());
      check(true, "raw_alloc(4 GiB) over a 2 GiB cap raises c10::OutOfMemoryError", msg.substr(0, 300));
      check(lower(msg).find("out of memory") != std::string::npos, "the message says \"out of memory\"");
    } catch (const c10::Error& e) {
      check(false, "raw_alloc(4 GiB) over a 2 GiB cap raises c10::OutOfMemoryError",
          "raised another c10::Error: " + first_line(e.what_without_backtrace()));
    }
    (void)cudaGetLastError();
    const Stats a = device_stats();
    info("after the OOM: " + stats_line(a));
    if (oom) {
      check(a.num_ooms > b.num_ooms, "getDeviceStats: num_ooms grew", strf("%lld -> %lld", static_cast<long long>(b.num_ooms), static_cast<long long>(a.num_ooms)));
    }
    // Recovery under the cap, then without it.
    void* small = cca::raw_alloc(512 * MiB);
    write_data(small, 512 * MiB, 500);
    std::string r = verify_data(small, 512 * MiB, 500);
    check(small != nullptr && r.empty(), "then raw_alloc(512 MiB) under the cap works (data intact)", r);
    cca::raw_delete(small);
    set_fraction(1.0);
    void* large = cca::raw_alloc(4 * GiB);
    write_data(large, 4 * GiB, 501);
    r = verify_data(large, 4 * GiB, 501);
    check(large != nullptr && r.empty(), "with the fraction back at 1.0, raw_alloc(4 GiB) works (data intact)", r);
    cca::raw_delete(large);
    CUDA_OK(cudaDeviceSynchronize());
    cca::emptyCache();
    info("at the end: " + stats_line(device_stats()));
  });

  if (gm) {
    const std::string j = gmlake_json();
    info("gmlake_c10_stats_json(0) at the end: " + j.substr(0, 600) + (j.size() > 600 ? "..." : ""));
  }
  std::printf("RESULT torch %s backend %s: %s (%d checks, %d failed, %d skipped)\n", GMLAKE_TEST_TORCH_VERSION, backend.c_str(),
      g_failed == 0 ? "PASS" : "FAIL", g_checks, g_failed, g_skipped);
  for (const auto& f : g_failures) {
    std::printf("FAIL: %s\n", f.c_str());
  }
  std::fflush(stdout);
  return g_failed == 0 ? 0 : 1;
}
