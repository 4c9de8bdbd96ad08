// gmlake::History: see history.h.
#include "history.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace gmlake {

void History::configure(
    bool enabled,
    ContextRecorder recorder,
    size_t max_entries,
    When when,
    const std::vector<Action>& skip) {
  TORCH_CHECK(when == When::NEVER || recorder != nullptr, "gmlake: recordHistory needs a context recorder");
  std::lock_guard<std::mutex> g(mu_);
  record_history_ = enabled;
  recorder_ = enabled ? recorder : nullptr;
  max_entries_ = max_entries;
  when_ = enabled ? when : When::NEVER;
  skip_.fill(false);
  for (Action a : skip) {
    skip_[static_cast<size_t>(a)] = true;
  }
}

bool History::enabled() {
  std::lock_guard<std::mutex> g(mu_);
  return record_history_;
}

bool History::refresh() {
  bool on;
  {
    std::lock_guard<std::mutex> g(mu_);
    on = record_history_ || !trackers_.empty();
  }
  return tracing_.exchange(on) != on;
}

std::pair<bool, size_t> History::keep() {
  std::lock_guard<std::mutex> g(mu_);
  return {record_history_, max_entries_};
}

ContextPtr History::gather(When needed) {
  ContextRecorder rec = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (static_cast<int>(when_) < static_cast<int>(needed)) {
      return nullptr;
    }
    rec = recorder_;
  }
  return rec ? rec() : nullptr;
}

void History::keep_capped(DeviceHistory& dh, TraceRec rec, size_t cap) {
  dh.trace.push_back(std::move(rec));
  while (dh.trace.size() > cap) {
    dh.trace.pop_front();
  }
}

void History::push(DeviceHistory& dh, TraceRec rec) {
  // Caller holds dh.mu. Settings are read under mu_ (lock order: dh.mu, mu_).
  std::vector<TraceTracker> trackers;
  bool keep = false;
  size_t cap = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (skip_[static_cast<size_t>(rec.action)]) {
      return;
    }
    keep = record_history_;
    cap = max_entries_;
    trackers = trackers_;
    if (!compile_stack_.empty()) {
      rec.compile_context = compile_stack_.back();
    }
    rec.user_metadata = user_metadata_;
  }
  for (const auto& t : trackers) {
    t(rec);
  }
  if (keep && cap > 0) {
    keep_capped(dh, std::move(rec), cap);
  }
}

void History::drain(
    DeviceHistory& dh,
    int device,
    const rust::Vec<ffi::TraceRecord>& events,
    const ContextPtr& alloc_ctx,
    const ContextPtr& free_ctx) {
  // Caller holds dh.mu.
  When when;
  {
    std::lock_guard<std::mutex> g(mu_);
    when = when_;
  }
  for (const auto& ev : events) {
    if (static_cast<uint8_t>(ev.action) > static_cast<uint8_t>(Action::OOM)) {
      continue;
    }
    Action a = ev.action;
    ContextPtr ctx;
    switch (a) {
      case Action::FREE_REQUESTED:
      case Action::FREE_COMPLETED:
        ctx = when >= When::ALL ? free_ctx : nullptr;
        break;
      default:
        ctx = when >= When::ALLOC ? (alloc_ctx ? alloc_ctx : free_ctx) : nullptr;
        break;
    }
    PoolId pool{0, 0};
    push(
        dh,
        TraceRec{
            a,
            device,
            ev.addr,
            ev.size,
            reinterpret_cast<void*>(static_cast<uintptr_t>(ev.stream)),
            pool,
            c10::getApproximateTime(),
            std::move(ctx),
            std::string(),
            std::string()});
  }
}

void History::annotate(DeviceHistory& dh, int device, std::vector<std::pair<std::string, std::string>> md) {
  size_t cap;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!record_history_) {
      return;
    }
    cap = max_entries_;
  }
  std::lock_guard<std::mutex> g(dh.mu);
  dh.annotations.push_back(AnnotationRec{device, c10::getApproximateTime(), std::move(md)});
  while (dh.annotations.size() > std::max<size_t>(cap, 1)) {
    dh.annotations.pop_front();
  }
}

void History::push_compile_context(std::string ctx) {
  std::lock_guard<std::mutex> g(mu_);
  if (record_history_) {
    compile_stack_.push_back(std::move(ctx));
  }
}

void History::pop_compile_context() {
  std::lock_guard<std::mutex> g(mu_);
  if (!compile_stack_.empty()) {
    compile_stack_.pop_back();
  }
}

void History::set_user_metadata(std::string md) {
  std::lock_guard<std::mutex> g(mu_);
  user_metadata_ = std::move(md);
}

std::string History::user_metadata() {
  std::lock_guard<std::mutex> g(mu_);
  return user_metadata_;
}

void History::attach_oom_observer(OomObserver obs) {
  std::lock_guard<std::mutex> g(mu_);
  oom_observers_.push_back(std::move(obs));
}

std::vector<OomObserver> History::oom_observers() {
  std::lock_guard<std::mutex> g(mu_);
  return oom_observers_;
}

void History::attach_trace_tracker(TraceTracker tracker) {
  std::lock_guard<std::mutex> g(mu_);
  trackers_.push_back(std::move(tracker));
}

} // namespace gmlake
