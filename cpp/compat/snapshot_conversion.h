// PyTorch's snapshot structs (SegmentInfo, BlockInfo, TraceEntry, AnnotationEntry,
// SnapshotInfo) from gmlake's records (SnapshotData, TraceRec), for every supported torch
// version.
//
// The structs keep their meaning across versions but change shape: they move from
// c10::cuda::CUDACachingAllocator to c10::CachingDeviceAllocator (2.6), sizes go from int64_t to
// size_t, fields arrive over time (requested_size 2.0; is_expandable, owner_private_pool_id and
// block contexts 2.1 (2.0 keeps a History list per block); trace times, devices and
// annotations 2.6; trace pools and metadata 2.11), and TraceEntry's constructor grows with
// them. One template per struct fills whatever the given type has (as stats_conversion.h does
// for DeviceStats); what the structs cannot tell (is a gmlake segment reported as expandable?)
// is a SnapshotOptions field, and each version's config_metadata is filled by its adapter.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "gmlake_impl.h"

namespace gmlake {
namespace compat {
namespace detail {

// has_<name><T>: whether `expr` (over `t`, a T&) is well formed.
#define GMLAKE_DETECT(name, expr)                                                       \
  template <class T, class = void>                                                      \
  struct name : std::false_type {};                                                     \
  template <class T>                                                                    \
  struct name<T, std::void_t<decltype(std::declval<T&>().expr)>> : std::true_type {}

GMLAKE_DETECT(has_requested_size, requested_size);
GMLAKE_DETECT(has_is_expandable, is_expandable);
GMLAKE_DETECT(has_owner_pool, owner_private_pool_id);
GMLAKE_DETECT(has_block_context, context_when_allocated);
// 2.0: a block's allocation contexts as a list (1.13's `history` is a borrowed pointer).
GMLAKE_DETECT(has_history_list, history.size());
GMLAKE_DETECT(has_trace_time, time_);
GMLAKE_DETECT(has_trace_device, device_);
GMLAKE_DETECT(has_trace_pool, mempool_);
GMLAKE_DETECT(has_annotations, external_annotations);

#undef GMLAKE_DETECT

template <class T, class = void>
struct has_segment_map : std::false_type {};
template <class T>
struct has_segment_map<T, std::void_t<decltype(T::SEGMENT_MAP)>> : std::true_type {};

template <class T>
using member_t = std::decay_t<T>;

} // namespace detail

// What the version's structs cannot tell.
struct SnapshotOptions {
  // SegmentInfo::is_expandable for gmlake's segments (where the field exists).
  bool expandable = false;
};

// For versions whose TraceEntry has no time (before 2.6): no clock to convert times with.
struct NoClock {};

// The version's TraceEntry::Action of `a`. Before 2.1 there is no SEGMENT_MAP / SEGMENT_UNMAP:
// a page mapped is reported as memory obtained, a page unmapped as memory returned.
template <class Entry>
typename Entry::Action action_to(Action a) {
  switch (a) {
    case Action::ALLOC:
      return Entry::ALLOC;
    case Action::FREE_REQUESTED:
      return Entry::FREE_REQUESTED;
    case Action::FREE_COMPLETED:
      return Entry::FREE_COMPLETED;
    case Action::SEGMENT_ALLOC:
      return Entry::SEGMENT_ALLOC;
    case Action::SEGMENT_FREE:
      return Entry::SEGMENT_FREE;
    case Action::SEGMENT_MAP:
      if constexpr (detail::has_segment_map<Entry>::value) {
        return Entry::SEGMENT_MAP;
      } else {
        return Entry::SEGMENT_ALLOC;
      }
    case Action::SEGMENT_UNMAP:
      if constexpr (detail::has_segment_map<Entry>::value) {
        return Entry::SEGMENT_UNMAP;
      } else {
        return Entry::SEGMENT_FREE;
      }
    case Action::SNAPSHOT:
      return Entry::SNAPSHOT;
    case Action::OOM:
      return Entry::OOM;
  }
  return Entry::ALLOC;
}

// The version's TraceEntry of `r` (the time as recorded: approximate clock ticks).
template <class Entry>
Entry trace_entry_to(const TraceRec& r) {
  Entry* e = nullptr;
  using Addr = detail::member_t<decltype(e->addr_)>;
  using Stream = detail::member_t<decltype(e->stream_)>;
  const auto action = action_to<Entry>(r.action);
  const auto addr = static_cast<Addr>(r.addr);
  const auto size = static_cast<size_t>(r.size);
  const auto stream = static_cast<Stream>(r.stream);
  if constexpr (detail::has_trace_pool<Entry>::value) {
    using Pool = detail::member_t<decltype(e->mempool_)>;
    using Device = detail::member_t<decltype(e->device_)>;
    return Entry(action, static_cast<Device>(r.device), addr, size, stream, Pool{r.pool.first, r.pool.second},
                 r.time, r.context, r.compile_context, r.user_metadata);
  } else if constexpr (detail::has_trace_device<Entry>::value) {
    using Device = detail::member_t<decltype(e->device_)>;
    return Entry(action, static_cast<Device>(r.device), addr, size, stream, r.time, r.context);
  } else {
    return Entry(action, addr, size, stream, r.context);
  }
}

// The version's SegmentInfo of `s`, with its blocks.
template <class Segment>
Segment segment_to(const SegmentRec& s, const SnapshotOptions& opt) {
  Segment seg;
  using Size = detail::member_t<decltype(seg.total_size)>;
  seg.device = static_cast<detail::member_t<decltype(seg.device)>>(s.device);
  seg.address = static_cast<detail::member_t<decltype(seg.address)>>(s.address);
  seg.total_size = static_cast<Size>(s.total_size);
  if constexpr (detail::has_requested_size<Segment>::value) {
    seg.requested_size = static_cast<Size>(s.requested_size);
  }
  seg.allocated_size = static_cast<Size>(s.allocated_size);
  seg.active_size = static_cast<Size>(s.active_size);
  seg.stream = static_cast<detail::member_t<decltype(seg.stream)>>(s.stream);
  seg.is_large = s.is_large;
  if constexpr (detail::has_is_expandable<Segment>::value) {
    seg.is_expandable = opt.expandable;
  }
  if constexpr (detail::has_owner_pool<Segment>::value) {
    seg.owner_private_pool_id = detail::member_t<decltype(seg.owner_private_pool_id)>{s.pool.first, s.pool.second};
  }
  using Block = typename detail::member_t<decltype(seg.blocks)>::value_type;
  uint64_t at = s.address;
  for (const auto& b : s.blocks) {
    Block bi;
    using BlockSize = detail::member_t<decltype(bi.size)>;
    bi.size = static_cast<BlockSize>(b.size);
    if constexpr (detail::has_requested_size<Block>::value) {
      bi.requested_size = static_cast<BlockSize>(b.requested_size);
    }
    bi.allocated = b.allocated;
    bi.active = b.active;
    if constexpr (detail::has_block_context<Block>::value) {
      bi.context_when_allocated = b.context;
    } else if constexpr (detail::has_history_list<Block>::value) {
      using History = typename detail::member_t<decltype(bi.history)>::value_type;
      if (b.allocated) {
        bi.history.push_back(History{
            reinterpret_cast<void*>(static_cast<uintptr_t>(at)), static_cast<size_t>(b.requested_size), b.context});
      }
    }
    at += b.size;
    seg.blocks.push_back(std::move(bi));
  }
  return seg;
}

template <class Segment>
std::vector<Segment> segments_to(const SnapshotData& d, const SnapshotOptions& opt = {}) {
  std::vector<Segment> out;
  out.reserve(d.segments.size());
  for (const auto& s : d.segments) {
    out.push_back(segment_to<Segment>(s, opt));
  }
  return out;
}

// The version's SnapshotInfo of `d` (all but config_metadata, which the adapter fills). From
// 2.6 times are converted to microseconds since the epoch with `clock`
// (c10::ApproximateClockToUnixTimeConverter); before, pass none.
template <class Info, class Clock = NoClock>
Info snapshot_to(const SnapshotData& d, const SnapshotOptions& opt = {}, Clock* clock = nullptr) {
  Info info;
  using Segment = typename detail::member_t<decltype(info.segments)>::value_type;
  using Entry = typename detail::member_t<decltype(info.device_traces)>::value_type::value_type;
  info.segments = segments_to<Segment>(d, opt);
  auto to_us = [&]() {
    if constexpr (detail::has_trace_time<Entry>::value) {
      return clock->makeConverter();
    } else {
      return 0;
    }
  }();
  for (const auto& dev : d.traces) {
    std::vector<Entry> entries;
    entries.reserve(dev.size());
    for (const auto& r : dev) {
      Entry te = trace_entry_to<Entry>(r);
      if constexpr (detail::has_trace_time<Entry>::value) {
        te.time_.t_ = to_us(r.time);
      }
      entries.push_back(std::move(te));
    }
    info.device_traces.push_back(std::move(entries));
  }
  if constexpr (detail::has_annotations<Info>::value) {
    using Annotation = typename detail::member_t<decltype(info.external_annotations)>::value_type;
    for (const auto& a : d.annotations) {
      Annotation ae(static_cast<c10::DeviceIndex>(a.device), a.time);
      for (const auto& kv : a.metadata) {
        ae.recordUserMetadata(kv.first, kv.second);
      }
      ae.time_.t_ = to_us(a.time);
      info.external_annotations.push_back(std::move(ae));
    }
  }
  return info;
}

} // namespace compat
} // namespace gmlake
