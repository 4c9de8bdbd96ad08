// The random mixed pattern's operations, shared by bench/latency.cpp (which runs them through
// PyTorch's allocator interface) and bench/mixed_sequence.cpp (which writes them to a file that
// rust/gmlake-core/examples/mixed_calls.rs replays on the simulated device, MIXED_SEQUENCE=FILE).
// The pattern's driver calls depend on the sequence far more than on the device: over 200k
// pairs, other seeds of the same distribution give 4k to 33k calls at the defaults. So the
// simulation is compared with the GPU on the same sequence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace mixed {

struct Sequence {
  size_t live_n = 0;   // blocks alive
  size_t warm = 0;     // untimed pairs first
  size_t ops = 0;      // timed pairs
  size_t sampled = 0;  // pairs timed one by one after
  std::vector<uint32_t> idx;  // per pair: which live block is freed (warm + ops + sampled)
  std::vector<size_t> sz;     // per pair: the size allocated in its place
  std::vector<size_t> fill;   // the live blocks' first sizes
};

// `live_n` blocks of sizes log-uniform in [min_size, max_size]; warm-up max(ops / 5, 4 live)
// pairs, `ops` timed, min(ops / 5, 200k) sampled. The pairs are drawn first, then the fill:
// the order bench/latency.cpp has always used, so that its sequence for a seed is unchanged.
inline Sequence make(uint64_t seed, size_t min_size, size_t max_size, size_t live_n, size_t ops) {
  Sequence s;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> ud(std::log(static_cast<double>(min_size)),
                                            std::log(static_cast<double>(max_size)));
  auto draw_size = [&] { return static_cast<size_t>(std::exp(ud(rng))); };
  s.live_n = live_n;
  s.ops = ops;
  s.warm = std::max<size_t>(ops / 5, 4 * live_n);
  s.sampled = std::min<size_t>(ops / 5, 200000);
  const size_t total = s.warm + s.ops + s.sampled;
  s.idx.resize(total);
  s.sz.resize(total);
  std::uniform_int_distribution<size_t> ui(0, live_n - 1);
  for (size_t i = 0; i < total; ++i) {
    s.idx[i] = static_cast<uint32_t>(ui(rng));
    s.sz[i] = draw_size();
  }
  s.fill.resize(live_n);
  for (size_t i = 0; i < live_n; ++i) s.fill[i] = draw_size();
  return s;
}

// Little-endian u64 words: live_n, warm, ops, sampled, then the fill sizes, then (index, size)
// per pair. False if the file cannot be written.
inline bool write(const Sequence& s, const char* path) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr) return false;
  std::vector<uint64_t> w = {s.live_n, s.warm, s.ops, s.sampled};
  for (size_t x : s.fill) w.push_back(x);
  for (size_t i = 0; i < s.idx.size(); ++i) {
    w.push_back(s.idx[i]);
    w.push_back(s.sz[i]);
  }
  const bool ok = std::fwrite(w.data(), sizeof(uint64_t), w.size(), f) == w.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace mixed
