// Messages logged once per key to stderr (gmlake::Impl and its units: history, pool routing,
// IPC cache).
#pragma once

#include <cstdio>
#include <map>
#include <mutex>
#include <string>

namespace gmlake {

class OnceLog {
 public:
  // Never throws: logging must never fail an operation.
  void operator()(const char* key, const std::string& msg) noexcept {
    try {
      std::lock_guard<std::mutex> g(mu_);
      int& n = logged_[key];
      if (n++ == 0) {
        std::fprintf(stderr, "[gmlake] %s (logged once)\n", msg.c_str());
        std::fflush(stderr);
      }
    } catch (...) {
    }
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> logged_;
};

} // namespace gmlake
