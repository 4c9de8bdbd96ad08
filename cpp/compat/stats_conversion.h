// PyTorch's DeviceStats from gmlake's statistics, for every supported torch version.
//
// The structs have the same fields across versions, but live in different namespaces
// (c10::cuda::CUDACachingAllocator up to 2.5, c10::CachingDeviceAllocator from 2.6) and grow
// over time: requested_bytes arrived in 2.0, num_sync_all_streams / num_device_alloc /
// num_device_free in 2.3. One template fills whatever the given struct has.
#pragma once

#include <array>
#include <type_traits>
#include <utility>

namespace gmlake {
namespace compat {
namespace detail {

template <class T, class = void>
struct has_requested_bytes : std::false_type {};
template <class T>
struct has_requested_bytes<T, std::void_t<decltype(std::declval<T&>().requested_bytes)>>
    : std::true_type {};

template <class T, class = void>
struct has_device_counters : std::false_type {};
template <class T>
struct has_device_counters<T, std::void_t<decltype(std::declval<T&>().num_device_alloc)>>
    : std::true_type {};

template <class Stat>
Stat stat_to(const ffi::Stat& s) {
  Stat t;
  t.current = s.current;
  t.peak = s.peak;
  t.allocated = s.allocated;
  t.freed = s.freed;
  return t;
}

template <class StatArray>
StatArray stat_array_to(const std::array<ffi::Stat, 3>& a) {
  StatArray t;
  using Stat = std::decay_t<decltype(t[0])>;
  for (size_t i = 0; i < 3; ++i) {
    t[i] = stat_to<Stat>(a[i]);
  }
  return t;
}

} // namespace detail

template <class DeviceStats>
DeviceStats device_stats_to(const ffi::Stats& s) {
  using StatArray = decltype(DeviceStats::allocation);
  using Stat = decltype(DeviceStats::oversize_allocations);
  DeviceStats t;
  t.allocation = detail::stat_array_to<StatArray>(s.allocation);
  t.segment = detail::stat_array_to<StatArray>(s.segment);
  t.active = detail::stat_array_to<StatArray>(s.active);
  t.inactive_split = detail::stat_array_to<StatArray>(s.inactive_split);
  t.allocated_bytes = detail::stat_array_to<StatArray>(s.allocated_bytes);
  t.reserved_bytes = detail::stat_array_to<StatArray>(s.reserved_bytes);
  t.active_bytes = detail::stat_array_to<StatArray>(s.active_bytes);
  t.inactive_split_bytes = detail::stat_array_to<StatArray>(s.inactive_split_bytes);
  if constexpr (detail::has_requested_bytes<DeviceStats>::value) {
    t.requested_bytes = detail::stat_array_to<StatArray>(s.requested_bytes);
  }
  t.num_alloc_retries = s.num_alloc_retries;
  t.num_ooms = s.num_ooms;
  t.oversize_allocations = detail::stat_to<Stat>(s.oversize_allocations);
  t.oversize_segments = detail::stat_to<Stat>(s.oversize_segments);
  if constexpr (detail::has_device_counters<DeviceStats>::value) {
    t.num_sync_all_streams = s.num_sync_all_streams;
    t.num_device_alloc = s.num_device_alloc;
    t.num_device_free = s.num_device_free;
  }
  t.max_split_size = s.max_split_size;
  return t;
}

} // namespace compat
} // namespace gmlake
