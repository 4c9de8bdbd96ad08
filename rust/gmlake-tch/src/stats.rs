//! Statistics as `gmlake_stats_json` reports them, with PyTorch's `DeviceStats` names.

use std::collections::BTreeMap;
use std::fmt;

use crate::Error;

/// One counter, as PyTorch's `c10::CachingAllocator::Stat`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

/// A counter per pool, as PyTorch's `StatArray` (`all`, `small_pool`, `large_pool`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatArray {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

/// gmlake's own counters (the `gmlake.*` keys).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GmlakeCounters {
    /// Requests served by stitching free pages into a new virtual range.
    pub stitches: i64,
    /// Physical pages mapped by those stitches.
    pub pages_stitched: i64,
    /// Bytes held in free mapped blocks (reusable without the driver).
    pub cached_bytes: i64,
    /// Bytes of old mappings of stitched pages waiting to be unmapped.
    pub retired_bytes: i64,
    /// Frees waiting for events of other streams.
    pub pending_frees: i64,
    /// Frees of pointers gmlake did not allocate (allocated before the install).
    pub unknown_frees: i64,
    /// Allocations shared with other processes (CUDA IPC), ranges of other processes mapped
    /// now, and their bytes.
    pub ipc_shares: i64,
    pub ipc_imports: i64,
    pub ipc_imported_bytes: i64,
    /// CUDA driver calls (create, map, unmap, set-access, ...), in total and by kind.
    pub driver_calls: i64,
    pub driver_calls_by_kind: BTreeMap<String, i64>,
    /// Host nanoseconds those calls took (every call timed).
    pub driver_ns: i64,
    /// The device's free and total memory when the statistics were read.
    pub device_free: Option<i64>,
    pub device_total: Option<i64>,
    /// The physical page size (the device's allocation granularity, 2 MiB on an H100).
    pub page_size: Option<i64>,
}

/// One device's statistics. The fields are PyTorch's `DeviceStats` (the names of
/// `torch.cuda.memory_stats()`), plus gmlake's counters. In gmlake a *segment* is a physical
/// page, `reserved_bytes` the bytes of pages held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// False when gmlake has not yet created the device's allocator (no CUDA tensor on it
    /// yet): every counter is then zero.
    pub initialized: bool,
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    pub max_split_size: i64,
    pub gmlake: GmlakeCounters,
    /// Every numeric key of the JSON, including any this struct does not name.
    pub raw: BTreeMap<String, i64>,
}

impl Stats {
    /// Parses the flat JSON object of `gmlake_stats_json` (`"{}"`: not initialized).
    pub fn from_json(text: &str) -> Result<Stats, Error> {
        let parse_err = |detail: String| Error::Parse {
            function: "gmlake_stats_json",
            detail,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| parse_err(e.to_string()))?;
        let obj = value
            .as_object()
            .ok_or_else(|| parse_err(format!("not a JSON object: {text:.80}")))?;
        let mut raw = BTreeMap::new();
        for (k, v) in obj {
            let n = if let Some(i) = v.as_i64() {
                i
            } else if let Some(u) = v.as_u64() {
                i64::try_from(u).unwrap_or(i64::MAX)
            } else if let Some(f) = v.as_f64() {
                f as i64
            } else {
                continue; // non-numeric keys are not statistics
            };
            raw.insert(k.clone(), n);
        }
        let get = |k: &str| raw.get(k).copied().unwrap_or(0);
        let stat = |p: &str| Stat {
            current: get(&format!("{p}.current")),
            peak: get(&format!("{p}.peak")),
            allocated: get(&format!("{p}.allocated")),
            freed: get(&format!("{p}.freed")),
        };
        let array = |name: &str| StatArray {
            all: stat(&format!("{name}.all")),
            small_pool: stat(&format!("{name}.small_pool")),
            large_pool: stat(&format!("{name}.large_pool")),
        };
        let driver_calls_by_kind = raw
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix("gmlake.driver_calls.")
                    .map(|kind| (kind.to_string(), *v))
            })
            .collect();
        Ok(Stats {
            // `gmlake.initialized` (0 for a device without an allocator yet, whose counters
            // are all zero); libraries before it sent `{}` for such a device.
            initialized: raw
                .get("gmlake.initialized")
                .map_or(!obj.is_empty(), |&v| v != 0),
            allocation: array("allocation"),
            segment: array("segment"),
            active: array("active"),
            inactive_split: array("inactive_split"),
            allocated_bytes: array("allocated_bytes"),
            reserved_bytes: array("reserved_bytes"),
            active_bytes: array("active_bytes"),
            inactive_split_bytes: array("inactive_split_bytes"),
            requested_bytes: array("requested_bytes"),
            num_alloc_retries: get("num_alloc_retries"),
            num_ooms: get("num_ooms"),
            oversize_allocations: stat("oversize_allocations"),
            oversize_segments: stat("oversize_segments"),
            num_sync_all_streams: get("num_sync_all_streams"),
            num_device_alloc: get("num_device_alloc"),
            num_device_free: get("num_device_free"),
            max_split_size: get("max_split_size"),
            gmlake: GmlakeCounters {
                stitches: get("gmlake.stitches"),
                pages_stitched: get("gmlake.pages_stitched"),
                cached_bytes: get("gmlake.cached_bytes"),
                retired_bytes: get("gmlake.retired_bytes"),
                pending_frees: get("gmlake.pending_frees"),
                unknown_frees: get("gmlake.unknown_frees"),
                ipc_shares: get("gmlake.ipc_shares"),
                ipc_imports: get("gmlake.ipc_imports"),
                ipc_imported_bytes: get("gmlake.ipc_imported_bytes"),
                driver_calls: get("gmlake.driver_calls"),
                driver_calls_by_kind,
                driver_ns: get("gmlake.driver_ns"),
                device_free: raw.get("gmlake.device_free").copied(),
                device_total: raw.get("gmlake.device_total").copied(),
                page_size: raw.get("gmlake.page_size").copied(),
            },
            raw,
        })
    }

    /// A statistic by its `torch.cuda.memory_stats()` key (e.g. `"active_bytes.all.peak"`)
    /// or gmlake key (`"gmlake.stitches"`).
    pub fn get(&self, key: &str) -> Option<i64> {
        self.raw.get(key).copied()
    }

    /// Peak active bytes / peak reserved bytes: how much of the memory taken from the GPU
    /// was ever in use at once (1.0: no fragmentation at the peak). None before any
    /// reservation.
    pub fn utilization(&self) -> Option<f64> {
        let reserved = self.reserved_bytes.all.peak;
        (reserved > 0).then(|| self.active_bytes.all.peak as f64 / reserved as f64)
    }
}

fn mib(b: i64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl fmt::Display for Stats {
    /// A few lines: memory now and at the peak, counts, gmlake's counters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.initialized {
            return f.write_str("no allocation on this device yet");
        }
        let a = &self.active_bytes.all;
        let r = &self.reserved_bytes.all;
        writeln!(
            f,
            "active {:.1} MiB (peak {:.1}), reserved {:.1} MiB (peak {:.1}), utilization {}",
            mib(a.current),
            mib(a.peak),
            mib(r.current),
            mib(r.peak),
            self.utilization()
                .map_or_else(|| "-".to_string(), |u| format!("{u:.3}"))
        )?;
        writeln!(
            f,
            "allocations {} (live {}), device allocs {} / frees {}, retries {}, ooms {}",
            self.allocation.all.allocated,
            self.allocation.all.current,
            self.num_device_alloc,
            self.num_device_free,
            self.num_alloc_retries,
            self.num_ooms
        )?;
        let g = &self.gmlake;
        write!(
            f,
            "stitches {} ({} pages), cached {:.1} MiB, retired {:.1} MiB, driver calls {}",
            g.stitches,
            g.pages_stitched,
            mib(g.cached_bytes),
            mib(g.retired_bytes),
            g.driver_calls
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_object_is_an_uninitialized_device() {
        let s = Stats::from_json("{}").unwrap();
        assert!(!s.initialized);
        assert_eq!(s.utilization(), None);
        assert_eq!(s.to_string(), "no allocation on this device yet");
        // The library's zero statistics of a device without an allocator say so.
        let z = Stats::from_json(r#"{"allocation.all.current":0,"gmlake.initialized":0}"#).unwrap();
        assert!(!z.initialized);
        assert!(
            Stats::from_json(r#"{"gmlake.initialized":1}"#)
                .unwrap()
                .initialized
        );
    }

    #[test]
    fn parses_torch_and_gmlake_keys() {
        let text = r#"{"allocation.all.current":3,"allocation.all.peak":5,
            "allocation.all.allocated":10,"allocation.all.freed":7,
            "allocation.large_pool.allocated":4,
            "active_bytes.all.peak":3000,"reserved_bytes.all.peak":4000,
            "reserved_bytes.all.current":4000,"num_ooms":1,"num_device_alloc":2,
            "oversize_segments.peak":9,"max_split_size":-1,
            "gmlake.stitches":6,"gmlake.pages_stitched":12,"gmlake.driver_calls":20,
            "gmlake.driver_calls.map":15,"gmlake.driver_calls.create":5,
            "gmlake.page_size":2097152,"gmlake.device_total":18446744073709551615,
            "gmlake.ipc_shares":2,"gmlake.ipc_imports":1,"gmlake.ipc_imported_bytes":4194304,
            "note":"ignored","ratio":0.5}"#;
        let s = Stats::from_json(text).unwrap();
        assert!(s.initialized);
        assert_eq!(
            s.allocation.all,
            Stat {
                current: 3,
                peak: 5,
                allocated: 10,
                freed: 7
            }
        );
        assert_eq!(s.allocation.large_pool.allocated, 4);
        assert_eq!(s.utilization(), Some(0.75));
        assert_eq!(s.num_ooms, 1);
        assert_eq!(s.oversize_segments.peak, 9);
        assert_eq!(s.max_split_size, -1);
        assert_eq!(s.gmlake.stitches, 6);
        assert_eq!(s.gmlake.pages_stitched, 12);
        assert_eq!(
            (
                s.gmlake.ipc_shares,
                s.gmlake.ipc_imports,
                s.gmlake.ipc_imported_bytes
            ),
            (2, 1, 4 << 20)
        );
        assert_eq!(s.gmlake.driver_calls_by_kind.len(), 2);
        assert_eq!(s.gmlake.driver_calls_by_kind["map"], 15);
        assert_eq!(s.gmlake.page_size, Some(2 << 20));
        assert_eq!(s.gmlake.device_total, Some(i64::MAX));
        assert_eq!(s.gmlake.device_free, None);
        assert_eq!(s.get("ratio"), Some(0));
        assert_eq!(s.get("note"), None);
        assert_eq!(s.get("gmlake.stitches"), Some(6));
        let shown = s.to_string();
        assert!(shown.contains("utilization 0.750"), "{shown}");
        assert!(shown.contains("stitches 6 (12 pages)"), "{shown}");
    }

    #[test]
    fn bad_text_is_a_parse_error() {
        for bad in ["", "[1,2]", "{\"a\":", "null"] {
            assert!(
                matches!(Stats::from_json(bad), Err(Error::Parse { .. })),
                "{bad}"
            );
        }
    }
}
