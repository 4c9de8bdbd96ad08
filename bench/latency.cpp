// Allocator latency through c10's CUDA allocator interface, for PyTorch's native caching
// allocator, its expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the
// environment) and gmlake (libgmlake_torch.so loaded with dlopen and installed with
// gmlake_install before anything touches CUDA).
//
//   latency --allocator native|expandable|gmlake [--lib libgmlake_torch.so] [--conf k:v,...]
//           [--out results.jsonl] [--quick] [--no-fixed] [--no-mixed] [--no-stitch]
//           [--mixed-live 10000] [--mixed-min 512] [--mixed-max 33554432] [--mixed-ops 1000000]
//           [--ops FILE [--ops-passes 3]]
//
// Tests (one JSON line each, on stdout and appended to --out):
//  - fixed: raw_alloc + raw_delete of one size in a loop (a cache hit after the first), sizes
//    512 B to 1 GiB by powers of 4 (and 1 GiB); ns per pair, median of 5 repetitions.
//  - mixed: `live` blocks alive, sizes log-uniform in [min, max]; each iteration frees a random
//    live block and allocates a random size in its place (pre-generated, same sequence for every
//    allocator); ns per operation (alloc or free) and per pair; then a sampled pass timing each
//    operation for percentiles.
//  - stitch: allocate k blocks of m pages (2 MiB each), free every other one, allocate one block
//    of the freed size in total; the time of that allocation, and with gmlake the pages it
//    stitched (gmlake_stats_json's gmlake.pages_stitched delta): microseconds per page stitched.
//    Native and expandable serve the same request from new device memory: their time is shown
//    for comparison.
//  - ops (with --ops FILE, instead of the others): a real job's allocations and frees, written
//    from its memory snapshot by `gmlake ops SNAPSHOT --out FILE`. The list's first half is the
//    warm-up; ns per operation of its second half (the job's steady state, as `gmlake replay`'s
//    "second half"), and gmlake's driver calls there: the allocator's own share of the job's step
//    time (its operations per step times ns per operation), free of the Python and launch noise
//    that moves the job's steps by 30%. Then the whole list `--ops-passes - 1` more times (every
//    block is freed at its end): ns per operation of each such pass.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include "mixed_sequence.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace cca = c10::cuda::CUDACachingAllocator;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

struct Options {
  std::string allocator = "native";
  std::string lib;
  std::string conf;
  std::string out;
  bool quick = false;
  bool fixed = true, mixed = true, stitch = true;
  size_t mixed_live = 10000;
  size_t mixed_min = 512;
  size_t mixed_max = 32 * MiB;
  size_t mixed_ops = 1000000;
  uint64_t seed = 42;
  std::string ops;
  size_t ops_passes = 3;
};

Options opt;
std::string g_gpu, g_backend;
using json_fn = long long (*)(int, char*, size_t);
json_fn g_stats_json = nullptr;

double ns_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
}

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      o += ' ';
    } else {
      o += c;
    }
  }
  return o;
}

// A JSON object built field by field.
struct Rec {
  std::ostringstream o;
  bool first = true;
  explicit Rec(const char* kind) {
    o.precision(6);
    o << "{";
    str("kind", kind);
    str("allocator", opt.allocator);
    str("backend", g_backend);
    str("gpu", g_gpu);
  }
  void key(const char* k) {
    if (!first) o << ",";
    first = false;
    o << "\"" << k << "\":";
  }
  Rec& str(const char* k, const std::string& v) {
    key(k);
    o << "\"" << esc(v) << "\"";
    return *this;
  }
  Rec& num(const char* k, double v) {
    key(k);
    if (std::isfinite(v)) {
      o << std::fixed << v;
      o.unsetf(std::ios::floatfield);
    } else {
      o << "null";
    }
    return *this;
  }
  Rec& integer(const char* k, long long v) {
    key(k);
    o << v;
    return *this;
  }
  Rec& boolean(const char* k, bool v) {
    key(k);
    o << (v ? "true" : "false");
    return *this;
  }
  Rec& nums(const char* k, const std::vector<double>& v) {
    key(k);
    o << "[";
    for (size_t i = 0; i < v.size(); ++i) {
      o << (i ? "," : "") << v[i];
    }
    o << "]";
    return *this;
  }
  void emit() {
    o << "}";
    const std::string line = o.str();
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    if (!opt.out.empty()) {
      if (FILE* f = std::fopen(opt.out.c_str(), "a")) {
        std::fprintf(f, "%s\n", line.c_str());
        std::fclose(f);
      }
    }
  }
};

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double percentile(std::vector<double>& sorted, double p) {
  if (sorted.empty()) return NAN;
  size_t i = static_cast<size_t>(p * (sorted.size() - 1) + 0.5);
  return sorted[std::min(i, sorted.size() - 1)];
}

void* alloc(size_t n) {
  return cca::raw_alloc(n);
}
void release(void* p) {
  cca::raw_delete(p);
}

const c10::CachingDeviceAllocator::DeviceStats stats() {
  return cca::getDeviceStats(0);
}

long long gmlake_counter(const char* name) {
  if (g_stats_json == nullptr) return -1;
  const long long n = g_stats_json(0, nullptr, 0);
  if (n < 0) return -1;
  std::string buf(static_cast<size_t>(n) + 1, '\0');
  if (g_stats_json(0, buf.data(), buf.size()) < 0) return -1;
  const std::string key = std::string("\"") + name + "\":";
  const auto pos = buf.find(key);
  if (pos == std::string::npos) return -1;
  return std::strtoll(buf.c_str() + pos + key.size(), nullptr, 10);
}

// gmlake's driver calls by kind and stitching counters, read around a timed part (-1 where
// the allocator is not gmlake): what the replay's cost model (rust/gmlake-core/src/cost.rs)
// is checked against (bench/cost_check.py reads the `calls_timed.*` keys; the stitching
// counters are `counters_timed.*`).
const char* const kCountedKeys[] = {
    "gmlake.driver_calls.map", "gmlake.driver_calls.set_access", "gmlake.driver_calls.unmap",
    "gmlake.driver_calls.create_physical", "gmlake.driver_calls.release_physical",
    "gmlake.driver_calls.record_event", "gmlake.driver_calls.query_event",
    "gmlake.driver_calls.stream_wait", "gmlake.driver_calls.synchronize",
    "gmlake.driver_calls.create_event", "gmlake.driver_calls.reserve_va", "gmlake.driver_calls.free_va",
    "gmlake.pages_stitched", "gmlake.stitch_reuses", "gmlake.aliases_replaced",
    // 1 in `counters_timed.page_upgrades` where the page-size upgrade happened in the timed
    // part: its one-time cost (the first generation unmapped and released) is then in ns/op.
    "gmlake.page_upgrades", "gmlake.pages_drained"};
constexpr size_t kCounted = sizeof(kCountedKeys) / sizeof(kCountedKeys[0]);

// `calls_timed.KIND` for a driver call kind, `counters_timed.NAME` for the stitching counters
// (bench/cost_check.py sums the former only).
std::string timed_key(const std::string& name) {
  const auto dot = name.rfind('.');
  const bool call = name.rfind("gmlake.driver_calls.", 0) == 0;
  return (call ? "calls_timed." : "counters_timed.") + name.substr(dot + 1);
}

std::vector<long long> gmlake_counters() {
  std::vector<long long> v;
  for (const char* k : kCountedKeys) v.push_back(gmlake_counter(k));
  return v;
}

// The counters' changes over a timed part, as timed_key names them (none where gmlake is not
// the allocator).
void add_timed_counters(Rec& rec, const std::vector<long long>& before,
                        const std::vector<long long>& after) {
  for (size_t k = 0; k < kCounted; ++k) {
    if (before[k] < 0 || after[k] < 0) continue;
    rec.integer(timed_key(kCountedKeys[k]).c_str(), after[k] - before[k]);
  }
}

// A latency_error record with `why`, on stdout and in --out.
void report_error(const std::string& why) {
  Rec rec("latency_error");
  rec.str("error", why);
  rec.emit();
}

// ---- fixed sizes

void bench_fixed() {
  std::vector<size_t> sizes;
  for (size_t s = 512; s <= GiB; s *= 4) sizes.push_back(s);
  if (sizes.back() != GiB) sizes.push_back(GiB);
  const double target_ns = opt.quick ? 10e6 : 40e6; // per repetition
  const int reps = 5;
  for (size_t size : sizes) {
    // Warm: the first allocation of a size may create memory.
    for (int i = 0; i < 3; ++i) release(alloc(size));
    // Calibrate.
    long iters = 1000;
    for (;;) {
      auto t0 = Clock::now();
      for (long i = 0; i < iters; ++i) release(alloc(size));
      const double ns = ns_since(t0);
      if (ns > target_ns / 4 || iters >= (1L << 24)) {
        iters = std::max<long>(1000, static_cast<long>(iters * target_ns / std::max(ns, 1.0)));
        break;
      }
      iters *= 4;
    }
    std::vector<double> per;
    for (int r = 0; r < reps; ++r) {
      auto t0 = Clock::now();
      for (long i = 0; i < iters; ++i) release(alloc(size));
      per.push_back(ns_since(t0) / static_cast<double>(iters));
    }
    Rec rec("latency");
    rec.str("test", "fixed").integer("size", static_cast<long long>(size)).integer("iters", iters)
        .num("ns_per_pair", median(per)).num("ns_per_pair_min", *std::min_element(per.begin(), per.end()))
        .nums("reps_ns", per);
    rec.emit();
  }
  cca::emptyCache();
}

// ---- random mixed pattern

void bench_mixed() {
  const size_t live_n = opt.quick ? std::min<size_t>(opt.mixed_live, 2000) : opt.mixed_live;
  const size_t ops = opt.quick ? std::min<size_t>(opt.mixed_ops, 100000) : opt.mixed_ops;
  const mixed::Sequence seq = mixed::make(opt.seed, opt.mixed_min, opt.mixed_max, live_n, ops);
  const std::vector<uint32_t>& idx = seq.idx;
  const std::vector<size_t>& sz = seq.sz;
  const size_t warm = seq.warm;
  const size_t total = seq.idx.size();
  const size_t sampled = seq.sampled;
  std::vector<void*> live(live_n);
  auto t_fill = Clock::now();
  for (size_t i = 0; i < live_n; ++i) live[i] = alloc(seq.fill[i]);
  const double fill_ms = ns_since(t_fill) / 1e6;
  auto step = [&](size_t i) {
    const uint32_t j = idx[i];
    release(live[j]);
    live[j] = alloc(sz[i]);
  };
  auto t_warm = Clock::now();
  for (size_t i = 0; i < warm; ++i) step(i);
  const double warm_ms = ns_since(t_warm) / 1e6;
  auto before = stats();
  const long long stitches0 = gmlake_counter("gmlake.stitches");
  const std::vector<long long> counted0 = gmlake_counters();
  auto t0 = Clock::now();
  for (size_t i = warm; i < warm + ops; ++i) step(i);
  const double ns = ns_since(t0);
  auto after = stats();
  const long long stitches1 = gmlake_counter("gmlake.stitches");
  const std::vector<long long> counted1 = gmlake_counters();
  // Sampled pass: each operation timed (the clock itself costs ~20-40 ns per reading).
  std::vector<double> ta, tf;
  ta.reserve(sampled);
  tf.reserve(sampled);
  for (size_t i = warm + ops; i < total; ++i) {
    const uint32_t j = idx[i];
    auto a = Clock::now();
    release(live[j]);
    auto b = Clock::now();
    live[j] = alloc(sz[i]);
    auto c = Clock::now();
    tf.push_back(std::chrono::duration<double, std::nano>(b - a).count());
    ta.push_back(std::chrono::duration<double, std::nano>(c - b).count());
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tf.begin(), tf.end());
  auto s = stats();
  Rec rec("latency");
  rec.str("test", "mixed").integer("live", static_cast<long long>(live_n))
      .integer("min_size", static_cast<long long>(opt.mixed_min))
      .integer("max_size", static_cast<long long>(opt.mixed_max))
      .integer("ops_pairs", static_cast<long long>(ops)).integer("warm_pairs", static_cast<long long>(warm))
      .num("ns_per_op", ns / (2.0 * ops)).num("ns_per_pair", ns / ops)
      .num("fill_ms", fill_ms).num("warm_ms", warm_ms)
      .num("alloc_p50_ns", percentile(ta, 0.5)).num("alloc_p99_ns", percentile(ta, 0.99))
      .num("alloc_p999_ns", percentile(ta, 0.999)).num("alloc_max_ns", ta.empty() ? NAN : ta.back())
      .num("free_p50_ns", percentile(tf, 0.5)).num("free_p99_ns", percentile(tf, 0.99))
      .num("free_max_ns", tf.empty() ? NAN : tf.back())
      .integer("device_allocs_timed", after.num_device_alloc - before.num_device_alloc)
      .integer("device_frees_timed", after.num_device_free - before.num_device_free)
      .integer("alloc_retries", s.num_alloc_retries)
      .integer("stitches_timed", stitches0 >= 0 ? stitches1 - stitches0 : -1)
      .integer("live_bytes", s.allocated_bytes[0].current)
      .integer("peak_active_bytes", s.active_bytes[0].peak)
      .integer("peak_reserved_bytes", s.reserved_bytes[0].peak)
      .integer("reserved_bytes", s.reserved_bytes[0].current);
  add_timed_counters(rec, counted0, counted1);
  rec.emit();
  for (void* p : live) release(p);
  cca::emptyCache();
}

// ---- a recorded job's operations (`gmlake ops`)

struct OpList {
  size_t streams = 0, slots = 0;
  std::vector<uint64_t> word;  // per operation: kind | stream << 1 | slot << 8
  std::vector<uint64_t> size;  // per operation: bytes (0 for a free)
};

// The file of rust/gmlake-cli/src/ops.rs (little-endian u64 words: magic, streams, slots, ops,
// then two words per operation). `gmlake ops` checks every operation against the slots' states;
// here the bounds are checked again so a damaged file cannot index out of range.
bool read_ops(const std::string& path, OpList& l, std::string& why) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    why = "cannot open " + path;
    return false;
  }
  std::vector<uint64_t> w;
  uint64_t buf[4096];
  size_t got = 0;
  while ((got = std::fread(buf, sizeof(uint64_t), 4096, f)) > 0) w.insert(w.end(), buf, buf + got);
  const bool whole = std::feof(f) && !std::ferror(f);
  std::fclose(f);
  uint64_t magic = 0;
  std::memcpy(&magic, "GMLKOPS1", 8);
  if (!whole || w.size() < 4 || w[0] != magic) {
    why = path + " is not an operation list (write one with `gmlake ops SNAPSHOT --out FILE`)";
    return false;
  }
  const uint64_t n = w[3];
  l.streams = w[1];
  l.slots = w[2];
  // The checks of `Ops::from_bytes` (rust/gmlake-cli/src/ops.rs): sizes from the header
  // against the file's, and every operation against its slot's state.
  if (n == 0 || n > (w.size() - 4) / 2 || w.size() != 4 + 2 * n || l.streams > 128 || l.slots > n) {
    why = path + ": its header (" + std::to_string(n) + " operations, " + std::to_string(l.slots) +
          " slots, " + std::to_string(l.streams) + " streams) does not match its " +
          std::to_string(w.size()) + " words";
    return false;
  }
  std::vector<bool> full(l.slots, false);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = w[4 + 2 * i], size = w[5 + 2 * i];
    const uint64_t slot = x >> 8;
    const bool alloc = (x & 1) == 0;
    const bool ok = slot < l.slots && (alloc ? ((x >> 1) & 0x7f) < l.streams && size > 0 && !full[slot]
                                             : full[slot]);
    if (!ok) {
      why = path + ": operation " + std::to_string(i) + " does not fit its slot's state";
      return false;
    }
    full[slot] = alloc;
    l.word.push_back(x);
    l.size.push_back(size);
  }
  for (bool b : full) {
    if (b) {
      why = path + ": a block is still live at the end";
      return false;
    }
  }
  return true;
}

// False (after a latency_error record) when the list cannot be read or run.
bool bench_ops() {
  OpList l;
  std::string why;
  if (!read_ops(opt.ops, l, why)) {
    report_error(why);
    return false;
  }
  // Stream 0 is the default stream; the others are made here (c10's stream pool needs
  // libtorch_cuda's hooks, which this program does not load).
  std::vector<cudaStream_t> streams(l.streams, nullptr);
  for (size_t i = 1; i < l.streams; ++i) {
    if (cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking) != cudaSuccess) {
      report_error("cudaStreamCreateWithFlags failed");
      return false;
    }
  }
  std::vector<void*> live(l.slots, nullptr);
  const size_t n = l.word.size();
  auto run = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) {
      const uint64_t x = l.word[i];
      void*& p = live[x >> 8];
      if (x & 1) {
        release(p);
        p = nullptr;
      } else {
        p = cca::raw_alloc_with_stream(l.size[i], streams[(x >> 1) & 0x7f]);
      }
    }
  };
  // The job as recorded: its first half untimed (warm-up), its second half timed.
  const size_t half = n / 2;
  auto t_warm = Clock::now();
  run(0, half);
  const double warm_ns = ns_since(t_warm);
  cca::resetPeakStats(0);
  auto before = stats();
  const std::vector<long long> counted0 = gmlake_counters();
  auto t0 = Clock::now();
  run(half, n);
  const double timed_ns = ns_since(t0);
  auto after = stats();
  const std::vector<long long> counted1 = gmlake_counters();
  auto s = stats();
  // Then the whole list again, pass after pass: a job whose steps free everything (its period
  // the whole recording).
  std::vector<double> repeat;
  const long long calls0 = gmlake_counter("gmlake.driver_calls");
  for (size_t k = 1; k < opt.ops_passes; ++k) {
    auto t = Clock::now();
    run(0, n);
    repeat.push_back(ns_since(t) / static_cast<double>(n));
  }
  const long long calls1 = gmlake_counter("gmlake.driver_calls");
  const auto slash = opt.ops.rfind('/');
  Rec rec("latency");
  rec.str("test", "ops").str("ops_file", slash == std::string::npos ? opt.ops : opt.ops.substr(slash + 1))
      .integer("ops", static_cast<long long>(n)).integer("streams", static_cast<long long>(l.streams))
      .integer("timed_ops", static_cast<long long>(n - half))
      .num("ns_per_op", timed_ns / static_cast<double>(n - half))
      .num("warm_ns_per_op", warm_ns / static_cast<double>(half))
      .nums("repeat_ns_per_op", repeat)
      .integer("repeat_driver_calls", calls0 >= 0 ? calls1 - calls0 : -1)
      .integer("device_allocs_timed", after.num_device_alloc - before.num_device_alloc)
      .integer("device_frees_timed", after.num_device_free - before.num_device_free)
      .integer("alloc_retries", s.num_alloc_retries)
      .integer("peak_active_bytes", s.active_bytes[0].peak)
      .integer("peak_reserved_bytes", s.reserved_bytes[0].peak)
      .num("utilization", s.reserved_bytes[0].peak > 0
                              ? static_cast<double>(s.active_bytes[0].peak) / s.reserved_bytes[0].peak
                              : NAN);
  add_timed_counters(rec, counted0, counted1);
  rec.emit();
  cca::emptyCache();
  for (size_t i = 1; i < l.streams; ++i) cudaStreamDestroy(streams[i]);
  return true;
}

// ---- stitch cost

void bench_stitch() {
  const size_t page = 2 * MiB;
  struct Shape {
    size_t pages_per_block;
    size_t blocks;
  };
  std::vector<Shape> shapes = {{1, 256}, {4, 64}, {16, 32}};
  const int rounds = opt.quick ? 2 : 5;
  double sum_us = 0, sum_pages = 0, sum_us_stitching = 0;
  long long stitched_rounds = 0;
  for (const Shape& sh : shapes) {
    std::vector<double> us_v, per_page_v;
    long long pages_total = 0;
    for (int r = 0; r < rounds; ++r) {
      cca::emptyCache();
      const size_t bsize = sh.pages_per_block * page;
      std::vector<void*> blocks(sh.blocks);
      for (auto& p : blocks) p = alloc(bsize);
      size_t freed = 0;
      for (size_t i = 1; i < blocks.size(); i += 2) {
        release(blocks[i]);
        blocks[i] = nullptr;
        freed += bsize;
      }
      c10::cuda::device_synchronize();
      const long long ps0 = gmlake_counter("gmlake.pages_stitched");
      const long long st0 = gmlake_counter("gmlake.stitches");
      auto before = stats();
      auto t0 = Clock::now();
      void* big = alloc(freed);
      const double us = ns_since(t0) / 1e3;
      auto after = stats();
      const long long ps1 = gmlake_counter("gmlake.pages_stitched");
      const long long st1 = gmlake_counter("gmlake.stitches");
      const long long pages = ps0 >= 0 ? ps1 - ps0 : -1;
      const long long device_allocs = after.num_device_alloc - before.num_device_alloc;
      us_v.push_back(us);
      if (pages > 0) {
        per_page_v.push_back(us / static_cast<double>(pages));
        pages_total += pages;
        sum_us_stitching += us;
        ++stitched_rounds;
      }
      sum_us += us;
      sum_pages += static_cast<double>(freed / page);
      Rec rec("stitch");
      rec.str("test", "stitch_round").integer("pages_per_block", static_cast<long long>(sh.pages_per_block))
          .integer("blocks", static_cast<long long>(sh.blocks)).integer("round", r)
          .integer("request_bytes", static_cast<long long>(freed))
          .integer("request_pages", static_cast<long long>(freed / page)).num("us", us)
          .integer("pages_stitched", pages).integer("stitches", st0 >= 0 ? st1 - st0 : -1)
          .integer("device_allocs", device_allocs)
          .num("us_per_page_stitched", pages > 0 ? us / static_cast<double>(pages) : NAN)
          .num("us_per_2mib_requested", us / static_cast<double>(freed / page));
      rec.emit();
      release(big);
      for (void* p : blocks) {
        if (p != nullptr) release(p);
      }
      c10::cuda::device_synchronize();
    }
    Rec rec("stitch");
    rec.str("test", "stitch").integer("pages_per_block", static_cast<long long>(sh.pages_per_block))
        .integer("blocks", static_cast<long long>(sh.blocks))
        .integer("request_pages", static_cast<long long>(sh.blocks / 2 * sh.pages_per_block))
        .num("us_median", median(us_v)).num("us_per_page_stitched_median", median(per_page_v))
        .integer("pages_stitched_total", pages_total).integer("rounds", rounds)
        .num("us_per_2mib_requested_median",
             median(us_v) / static_cast<double>(sh.blocks / 2 * sh.pages_per_block));
    rec.emit();
  }
  cca::emptyCache();
}

std::string read_env(const char* k) {
  const char* v = std::getenv(k);
  return v ? v : "";
}

int usage() {
  std::fprintf(stderr,
               "usage: latency --allocator native|expandable|gmlake [--lib PATH] [--conf K:V,...]\n"
               "               [--out FILE] [--quick] [--no-fixed] [--no-mixed] [--no-stitch]\n"
               "               [--mixed-live N] [--mixed-min BYTES] [--mixed-max BYTES] [--mixed-ops N]\n"
               "               [--ops FILE [--ops-passes N]]\n");
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto need = [&](const char* what) -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", what);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--allocator") opt.allocator = need("--allocator");
    else if (a == "--lib") opt.lib = need("--lib");
    else if (a == "--conf") opt.conf = need("--conf");
    else if (a == "--out") opt.out = need("--out");
    else if (a == "--quick") opt.quick = true;
    else if (a == "--no-fixed") opt.fixed = false;
    else if (a == "--no-mixed") opt.mixed = false;
    else if (a == "--no-stitch") opt.stitch = false;
    else if (a == "--mixed-live") opt.mixed_live = std::stoull(need("--mixed-live"));
    else if (a == "--mixed-min") opt.mixed_min = std::stoull(need("--mixed-min"));
    else if (a == "--mixed-max") opt.mixed_max = std::stoull(need("--mixed-max"));
    else if (a == "--mixed-ops") opt.mixed_ops = std::stoull(need("--mixed-ops"));
    else if (a == "--ops") opt.ops = need("--ops");
    else if (a == "--ops-passes") opt.ops_passes = std::stoull(need("--ops-passes"));
    else if (a == "-h" || a == "--help") return usage(), 0;
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return usage();
    }
  }
  const std::string conf_env = read_env("PYTORCH_CUDA_ALLOC_CONF");
  const bool env_expandable = conf_env.find("expandable_segments:True") != std::string::npos ||
      conf_env.find("expandable_segments:true") != std::string::npos;
  if (opt.allocator == "expandable" && !env_expandable) {
    std::fprintf(stderr, "--allocator expandable needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n");
    return 2;
  }
  if (opt.allocator != "expandable" && env_expandable) {
    std::fprintf(stderr, "PYTORCH_CUDA_ALLOC_CONF asks for expandable segments but --allocator is %s\n",
                 opt.allocator.c_str());
    return 2;
  }
  if (opt.allocator == "gmlake") {
    if (opt.lib.empty()) opt.lib = read_env("GMLAKE_LIBRARY");
    if (opt.lib.empty()) {
      std::fprintf(stderr, "--allocator gmlake needs --lib or GMLAKE_LIBRARY\n");
      return 2;
    }
    void* h = dlopen(opt.lib.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) {
      std::fprintf(stderr, "dlopen %s: %s\n", opt.lib.c_str(), dlerror());
      return 1;
    }
    using install_fn = int (*)(const char*);
    using err_fn = const char* (*)();
    auto install = reinterpret_cast<install_fn>(dlsym(h, "gmlake_install"));
    auto last_error = reinterpret_cast<err_fn>(dlsym(h, "gmlake_last_error"));
    g_stats_json = reinterpret_cast<json_fn>(dlsym(h, "gmlake_stats_json"));
    if (install == nullptr || last_error == nullptr || g_stats_json == nullptr) {
      std::fprintf(stderr, "%s lacks gmlake_install / gmlake_last_error / gmlake_stats_json\n", opt.lib.c_str());
      return 1;
    }
    if (install(opt.conf.c_str()) != 0) {
      std::fprintf(stderr, "gmlake_install failed: %s\n", last_error());
      return 1;
    }
  } else if (opt.allocator != "native" && opt.allocator != "expandable") {
    return usage();
  }
  try {
    const int n = c10::cuda::device_count();
    if (n < 1) {
      std::fprintf(stderr, "no CUDA device\n");
      return 1;
    }
    cca::init(n); // what torch's lazy CUDA init does
    c10::cuda::set_device(0);
    g_backend = cca::name();
    {
      cudaDeviceProp prop{};
      // c10 has no device-name accessor: ask the runtime torch loaded.
      if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) g_gpu = prop.name;
    }
    if (opt.allocator == "gmlake" && g_backend != "gmlake") {
      std::fprintf(stderr, "gmlake installed, but the allocator is %s\n", g_backend.c_str());
      return 1;
    }
    release(alloc(512)); // CUDA context, allocator state
    if (!opt.ops.empty()) {
      return bench_ops() ? 0 : 1;
    }
    if (opt.fixed) bench_fixed();
    if (opt.allocator == "expandable") {
      void* p = alloc(64 * MiB);
      bool seen = false;
      for (const auto& seg : cca::snapshot({0, 0}, false).segments) seen = seen || seg.is_expandable;
      release(p);
      Rec rec("latency_check");
      rec.boolean("expandable_segments_seen", seen);
      rec.emit();
    }
    if (opt.mixed) bench_mixed();
    if (opt.stitch) bench_stitch();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "c10 error: %s\n", e.what_without_backtrace());
    report_error(e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    report_error(e.what());
    return 1;
  }
  return 0;
}
