// The memory debugging mode's C++ side (GMLAKE_CONF=debug:...): canaries and poison, which
// need work on the allocation's stream. The core places guarded blocks, pads requests for
// canaries and keeps the quarantine (rust/gmlake-core/src/allocator/debug.rs); this fills the
// bytes after each request with a pattern at allocation (cudaMemsetAsync on its stream),
// copies them to pinned host memory at free (cudaMemcpyAsync + an event on the same stream,
// then the poison fill), and checks the copies once their events completed: at the next
// allocation or free, or at gmlake.debug_check(). Never a device-wide synchronisation.
//
// One DebugDevice per device, created with its allocator when the mode is on. Every method
// is noexcept: CUDA errors are reported on stderr once and the check is skipped.
#pragma once

#include <c10/core/Allocator.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace gmlake {

using ContextPtr = std::shared_ptr<c10::GatheredContext>;

// Bits of ffi debug_mode().
constexpr uint32_t kDebugGuard = 1;
constexpr uint32_t kDebugCanary = 2;
constexpr uint32_t kDebugPoison = 4;
constexpr uint32_t kDebugQuarantine = 8;
constexpr uint32_t kDebugGuardFront = 16;

// The canary byte and the poison byte (0xFF bytes are a NaN in fp32, fp16 and bf16).
constexpr uint8_t kCanaryByte = 0xA5;
constexpr uint8_t kPoisonByte = 0xFF;

struct DebugReport {
  uint64_t id = 0;
  std::string kind; // "canary"
  int device = 0;
  uint64_t address = 0;
  uint64_t requested = 0; // bytes asked for
  uint64_t size = 0; // bytes of the block (rounded, padded)
  uint64_t stream = 0;
  uint64_t first_bad = 0; // offset of the first damaged byte from the end of the request
  uint64_t bad_bytes = 0; // damaged canary bytes
  uint64_t canary_bytes = 0; // canary bytes checked
  std::string message;
  ContextPtr context; // recorded at allocation (when a context recorder is set)
};

class DebugDevice {
 public:
  DebugDevice(int device, uint32_t mode) : device_(device), mode_(mode) {}
  DebugDevice(const DebugDevice&) = delete;
  DebugDevice& operator=(const DebugDevice&) = delete;

  uint32_t mode() const {
    return mode_;
  }

  // After an allocation of `requested` bytes in a block of `size` at `ptr` on `stream`.
  void on_alloc(uint64_t ptr, uint64_t size, uint64_t requested, cudaStream_t stream, ContextPtr ctx) noexcept {
    try {
      std::lock_guard<std::mutex> g(mu_);
      live_[ptr] = Live{size, requested, stream, std::move(ctx)};
      if ((mode_ & kDebugCanary) && size > requested) {
        check(cudaMemsetAsync(reinterpret_cast<void*>(ptr + requested), kCanaryByte, size - requested, stream),
              "cudaMemsetAsync (canary)");
      }
    } catch (...) {
    }
  }

  // record_stream: the block is used on another stream too (its poison would race that use).
  void on_record_stream(uint64_t ptr) noexcept {
    try {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(ptr);
      if (it != live_.end()) {
        it->second.shared = true;
      }
    } catch (...) {
    }
  }

  // Before the core frees `ptr`: queues the canary copy, then poisons the block.
  void on_free(uint64_t ptr) noexcept {
    try {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(ptr);
      if (it == live_.end()) {
        return;
      }
      Live b = std::move(it->second);
      live_.erase(it);
      const uint64_t n = b.size > b.requested ? b.size - b.requested : 0;
      if ((mode_ & kDebugCanary) && n > 0 && n <= kSlot) {
        uint8_t* host = take_slot();
        cudaEvent_t ev = take_event();
        if (host != nullptr && ev != nullptr &&
            check(cudaMemcpyAsync(host, reinterpret_cast<const void*>(ptr + b.requested), n,
                                  cudaMemcpyDeviceToHost, b.stream),
                  "cudaMemcpyAsync (canary)") &&
            check(cudaEventRecord(ev, b.stream), "cudaEventRecord (canary)")) {
          pending_.push_back(Pending{ptr, b.size, b.requested, b.stream, std::move(b.ctx), host, n, ev});
        } else {
          if (host != nullptr) {
            slots_.push_back(host);
          }
          if (ev != nullptr) {
            events_.push_back(ev);
          }
        }
      }
      if ((mode_ & kDebugPoison) && !b.shared) {
        check(cudaMemsetAsync(reinterpret_cast<void*>(ptr), kPoisonByte, b.size, b.stream),
              "cudaMemsetAsync (poison)");
      }
    } catch (...) {
    }
  }

  // Checks the copies whose events completed (all of them, waiting for each, if `wait`).
  // Returns the new reports.
  std::vector<DebugReport> poll(bool wait) noexcept {
    std::vector<DebugReport> out;
    try {
      std::lock_guard<std::mutex> g(mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        cudaError_t st = wait ? cudaEventSynchronize(it->ev) : cudaEventQuery(it->ev);
        if (st == cudaErrorNotReady) {
          // Copies complete about in order: stop at the first one not done (the hot path
          // polls after every allocation and free; a scan of all would grow with the lag).
          (void)cudaGetLastError();
          break;
        }
        if (st != cudaSuccess) {
          (void)cudaGetLastError();
          // A sticky error (an illegal address): nothing more can be checked.
          log_once_locked("poll", std::string("cannot check canaries: ") + cudaGetErrorString(st));
          break;
        }
        uint64_t first = UINT64_MAX;
        uint64_t bad = 0;
        for (uint64_t i = 0; i < it->n; ++i) {
          if (it->host[i] != kCanaryByte) {
            first = first == UINT64_MAX ? i : first;
            ++bad;
          }
        }
        if (bad > 0) {
          DebugReport r;
          r.kind = "canary";
          r.device = device_;
          r.address = it->ptr;
          r.requested = it->requested;
          r.size = it->size;
          r.stream = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(it->stream));
          r.first_bad = first;
          r.bad_bytes = bad;
          r.canary_bytes = it->n;
          r.context = it->ctx;
          char buf[400];
          std::snprintf(
              buf,
              sizeof(buf),
              "buffer overflow: %llu of the %llu canary bytes after the allocation of %llu bytes "
              "at 0x%llx (block of %llu bytes, device %d, stream 0x%llx) were overwritten, the "
              "first %llu bytes past its end",
              static_cast<unsigned long long>(bad),
              static_cast<unsigned long long>(it->n),
              static_cast<unsigned long long>(it->requested),
              static_cast<unsigned long long>(it->ptr),
              static_cast<unsigned long long>(it->size),
              device_,
              static_cast<unsigned long long>(r.stream),
              static_cast<unsigned long long>(first));
          r.message = buf;
          out.push_back(std::move(r));
        }
        slots_.push_back(it->host);
        events_.push_back(it->ev);
        it = pending_.erase(it);
      }
    } catch (...) {
    }
    return out;
  }

  bool has_pending() noexcept {
    std::lock_guard<std::mutex> g(mu_);
    return !pending_.empty();
  }

 private:
  // Canary bytes checked per block at most: 511 rounding bytes + debug_canary_bytes (<= 4096).
  static constexpr uint64_t kSlot = 8192;
  static constexpr size_t kSlotsPerSlab = 256;

  struct Live {
    uint64_t size;
    uint64_t requested;
    cudaStream_t stream;
    ContextPtr ctx;
    bool shared = false;
  };
  struct Pending {
    uint64_t ptr;
    uint64_t size;
    uint64_t requested;
    cudaStream_t stream;
    ContextPtr ctx;
    uint8_t* host;
    uint64_t n;
    cudaEvent_t ev;
  };

  bool check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) {
      return true;
    }
    (void)cudaGetLastError();
    log_once_locked(what, std::string(what) + " failed: " + cudaGetErrorString(e));
    return false;
  }

  void log_once_locked(const std::string& key, const std::string& msg) {
    if (logged_.insert(key).second) {
      std::fprintf(stderr, "[gmlake] debug mode: %s (logged once)\n", msg.c_str());
      std::fflush(stderr);
    }
  }

  uint8_t* take_slot() {
    if (slots_.empty()) {
      void* slab = nullptr;
      if (!check(cudaHostAlloc(&slab, kSlot * kSlotsPerSlab, cudaHostAllocPortable), "cudaHostAlloc")) {
        return nullptr;
      }
      auto* p = static_cast<uint8_t*>(slab);
      for (size_t i = 0; i < kSlotsPerSlab; ++i) {
        slots_.push_back(p + i * kSlot);
      }
    }
    uint8_t* s = slots_.back();
    slots_.pop_back();
    return s;
  }

  cudaEvent_t take_event() {
    if (!events_.empty()) {
      cudaEvent_t e = events_.back();
      events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (!check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate")) {
      return nullptr;
    }
    return e;
  }

  const int device_;
  const uint32_t mode_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Live> live_;
  std::deque<Pending> pending_;
  std::vector<uint8_t*> slots_; // pinned, leaked with the process
  std::vector<cudaEvent_t> events_;
  std::unordered_set<std::string> logged_;
};

} // namespace gmlake
