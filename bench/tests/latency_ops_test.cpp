// bench/latency.cpp's reader of operation lists (`--ops`), without a GPU: the lists
// `gmlake ops` writes are read whole, damaged ones are refused with the reason. Built and run
// by scripts/build-torch-ext.sh; arguments: lists written by `gmlake ops`, each to be read.
#define main latency_main
#include "../latency.cpp"
#undef main

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

std::string write_words(const std::string& name, const std::vector<uint64_t>& w) {
  const std::string path = "/tmp/gmlake-latency-ops-test-" + std::to_string(::getpid()) + "-" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(w.data(), sizeof(uint64_t), w.size(), f);
  std::fclose(f);
  return path;
}

// Reads the list of `words`; true when it was accepted. `why` gets the reason otherwise.
bool accepts(const std::string& name, const std::vector<uint64_t>& words, std::string& why,
             OpList* out = nullptr) {
  const std::string path = write_words(name, words);
  OpList l;
  why.clear();
  const bool ok = read_ops(path, l, why);
  std::remove(path.c_str());
  if (out != nullptr) *out = l;
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t magic = 0;
  std::memcpy(&magic, "GMLKOPS1", 8);
  auto alloc = [](uint64_t slot, uint64_t stream) { return stream << 1 | slot << 8; };
  auto release = [](uint64_t slot) { return 1 | slot << 8; };
  // Two streams, two slots: allocate 512 B (stream 0) and 1 KiB (stream 1), free both.
  const std::vector<uint64_t> good = {magic, 2, 2, 4,
                                      alloc(0, 0), 512, alloc(1, 1), 1024, release(0), 0, release(1), 0};
  std::string why;
  OpList l;
  expect(accepts("good", good, why, &l), "a valid list is read: " + why);
  expect(l.word.size() == 4 && l.size[1] == 1024 && l.streams == 2 && l.slots == 2,
         "its operations, streams and slots");

  auto damaged = [&](const char* name, std::vector<uint64_t> w, const char* reason) {
    expect(!accepts(name, w, why), std::string(name) + " is refused");
    expect(why.find(reason) != std::string::npos, std::string(name) + ": reason '" + why + "'");
  };
  std::vector<uint64_t> w = good;
  w[0] ^= 1;
  damaged("magic", w, "not an operation list");
  w = good;
  w.pop_back();
  damaged("short", w, "does not match");
  w = good;
  w.push_back(0);
  w.push_back(0);
  damaged("long", w, "does not match");
  w = good;
  w[3] = (1ULL << 63) + 1;  // 2n wraps around
  damaged("wrapping count", w, "does not match");
  w = good;
  w[2] = 1ULL << 60;
  damaged("huge slot count", w, "does not match");
  w = good;
  w[3] = 0;
  w.resize(4);
  damaged("empty", w, "does not match");
  w = good;
  w[6] = alloc(0, 1);  // the second allocation into the live slot 0
  damaged("double allocation", w, "operation 1");
  w = good;
  w[8] = release(1);  // slot 1 freed twice, slot 0 never
  w[10] = release(1);
  damaged("double free", w, "operation 3");
  w = good;
  w[10] = alloc(0, 0);  // the last free is an allocation: live at the end
  w[11] = 64;
  damaged("live at the end", w, "still live at the end");
  w = good;
  w[4] = alloc(0, 2);  // stream 2 of 2
  damaged("stream out of range", w, "operation 0");
  w = good;
  w[5] = 0;  // an allocation of 0 bytes
  damaged("zero size", w, "operation 0");
  damaged("empty file", {}, "not an operation list");

  for (int i = 1; i < argc; ++i) {
    OpList ll;
    std::string reason;
    expect(read_ops(argv[i], ll, reason), std::string(argv[i]) + ": " + reason);
    expect(!ll.word.empty(), std::string(argv[i]) + " has operations");
  }
  if (failures == 0) std::printf("latency_ops_test: ok (%d lists from gmlake ops)\n", argc - 1);
  return failures == 0 ? 0 : 1;
}
