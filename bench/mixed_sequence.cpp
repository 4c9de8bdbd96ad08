// Writes bench/latency.cpp's random mixed sequence to a file, for
// rust/gmlake-core/examples/mixed_calls.rs to replay on the simulated device (no GPU, no torch):
//
//   g++ -O2 -o mixed_sequence bench/mixed_sequence.cpp
//   ./mixed_sequence --out seq.bin [--seed 42] [--mixed-live 10000] [--mixed-min 512]
//                    [--mixed-max 33554432] [--mixed-ops 1000000]
//   MIXED_SEQUENCE=seq.bin cargo run --release -p gmlake-core --example mixed_calls
//
// The defaults are latency.cpp's.
#include "mixed_sequence.h"

#include <cstdlib>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  uint64_t seed = 42;
  size_t live = 10000, min_size = 512, max_size = 32u << 20, ops = 1000000;
  const char* out = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "mixed_sequence: %s needs a value\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    const bool number = end != v && *end == '\0';
    if (a == "--out") {
      out = v;
      continue;
    }
    if (!number) {
      std::fprintf(stderr, "mixed_sequence: %s takes a number, not '%s'\n", a.c_str(), v);
      return 2;
    }
    if (a == "--seed") seed = n;
    else if (a == "--mixed-live") live = n;
    else if (a == "--mixed-min") min_size = n;
    else if (a == "--mixed-max") max_size = n;
    else if (a == "--mixed-ops") ops = n;
    else {
      std::fprintf(stderr, "mixed_sequence: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (out == nullptr || live == 0 || min_size == 0 || max_size < min_size) {
    std::fprintf(stderr, "usage: mixed_sequence --out FILE [--seed N] [--mixed-live N>0] [--mixed-min N>0] "
                         "[--mixed-max N>=min] [--mixed-ops N]\n");
    return 2;
  }
  const mixed::Sequence s = mixed::make(seed, min_size, max_size, live, ops);
  if (!mixed::write(s, out)) {
    std::fprintf(stderr, "mixed_sequence: cannot write %s\n", out);
    return 1;
  }
  std::printf("%s: seed %llu, %zu live, %zu warm-up + %zu timed + %zu sampled pairs\n", out,
              static_cast<unsigned long long>(seed), s.live_n, s.warm, s.ops, s.sampled);
  return 0;
}
