// gmlake's allocation history (torch.cuda.memory._record_memory_history): the settings
// (recorder, size, what to skip, compile contexts, user metadata), OOM observers and trace
// trackers, and per device the trace, the annotations and the contexts of live blocks. Used by
// gmlake::Impl (gmlake_impl.h), which serialises a device's traced operations with its
// DeviceHistory::mu so that the events the core records are attributed to the call that made
// them.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gmlake_types.h"

namespace gmlake {

class OnceLog;

// One device's history (guarded by `mu`).
struct DeviceHistory {
  std::mutex mu;
  std::deque<TraceRec> trace;
  std::deque<AnnotationRec> annotations;
  std::unordered_map<uint64_t, ContextPtr> contexts;
};

class History {
 public:
  // Settings. Returns nothing; refresh() says whether the cores must record events.
  void configure(bool enabled, ContextRecorder recorder, size_t max_entries, When when, const std::vector<Action>& skip);
  bool enabled();
  // Whether anything is recorded (history or trackers): the cores record events while it is.
  bool tracing() const {
    return tracing_.load();
  }
  // Recomputes tracing(); true when it changed.
  bool refresh();
  // Whether entries are kept, and how many at most.
  std::pair<bool, size_t> keep();

  // The context of the current call if the settings gather one for `needed`.
  ContextPtr gather(When needed);
  // Moves the core's recorded events into `dh` (held by the caller), attaching the contexts
  // per the settings.
  void drain(DeviceHistory& dh, int device, const rust::Vec<ffi::TraceRecord>& events,
             const ContextPtr& alloc_ctx, const ContextPtr& free_ctx);
  // Records `rec` (caller holds dh.mu): trackers are called, the entry kept if enabled.
  void push(DeviceHistory& dh, TraceRec rec);
  // Keeps `rec` in dh's trace, bounded by `cap` (caller holds dh.mu).
  static void keep_capped(DeviceHistory& dh, TraceRec rec, size_t cap);
  // An annotation on `device` (nothing when history is off).
  void annotate(DeviceHistory& dh, int device, std::vector<std::pair<std::string, std::string>> md);

  void push_compile_context(std::string ctx);
  void pop_compile_context();
  void set_user_metadata(std::string md);
  std::string user_metadata();
  void attach_oom_observer(OomObserver obs);
  std::vector<OomObserver> oom_observers();
  void attach_trace_tracker(TraceTracker tracker);

 private:
  // tracing_ mirrors "anything to record"; the rest is guarded by mu_ (lock order: a
  // DeviceHistory's mu, then mu_).
  std::atomic<bool> tracing_{false};
  std::mutex mu_;
  bool record_history_ = false;
  ContextRecorder recorder_ = nullptr;
  size_t max_entries_ = 0;
  When when_ = When::NEVER;
  std::array<bool, 9> skip_{};
  std::vector<TraceTracker> trackers_;
  std::vector<std::string> compile_stack_;
  std::string user_metadata_;
  std::vector<OomObserver> oom_observers_;
};

} // namespace gmlake
