//! The host tier (issue 16) through the bridge: one [`gmlake_core::Tier`] over a device's
//! allocator (whose device type is erased: `backend.rs`), handed to C++ as `GmlakeTier` with plain
//! integer arguments (tensor ids, pointers and streams as `u64`).
//!
//! Streams: every call names the stream the client works on. A tensor brought back by `get`
//! is ready for work queued on that stream after the call. When the copy that brought it back
//! (a prefetch, or an eviction rescued while its copy out was in flight) was queued on
//! another stream, `get` waits for the device first (the bridge passes no events to C++), so
//! what it returns is always safe on the stream asked for.

use crate::backend::Dev;
use crate::ffi::{TierConf, TierFetch, TierState, TierStatsRecord};
use crate::{core_err, guard, Gmlake};
use gmlake_core::{
    EvictionPolicy, Lru, SizeLatencyAware, TensorId, TensorState, Tier, TierConfig, TierStats,
};
use std::sync::Arc;

/// One device's tier, as C++ holds it.
pub struct GmlakeTier {
    core: Tier<Dev>,
}

/// Settings and policy from the bridge's [`TierConf`] (zeros: defaults), with
/// [`TierConfig::eager_free`] on.
pub fn settings(
    c: &TierConf,
) -> std::result::Result<(TierConfig, Box<dyn EvictionPolicy>), String> {
    let d = TierConfig::default();
    let policy: Box<dyn EvictionPolicy> = match c.policy.as_str() {
        "" | "aware" => Box::new(SizeLatencyAware::default()),
        "lru" => Box::new(Lru),
        other => {
            return Err(format!(
                "gmlake tier: unknown policy {other:?} (expected \"aware\" or \"lru\")"
            ))
        }
    };
    for (name, v) in [
        ("bandwidth", c.bandwidth),
        ("copy_latency", c.copy_latency),
        ("tick_seconds", c.tick_seconds),
    ] {
        if !v.is_finite() || v < 0.0 {
            return Err(format!(
                "gmlake tier: {name} must be a finite number >= 0, not {v}"
            ));
        }
    }
    let or = |v: f64, dflt: f64| if v > 0.0 { v } else { dflt };
    Ok((
        TierConfig {
            device_budget: c.has_budget.then_some(c.budget),
            bandwidth: or(c.bandwidth, d.bandwidth),
            copy_latency: or(c.copy_latency, d.copy_latency),
            tick_seconds: or(c.tick_seconds, d.tick_seconds),
            prefetch_margin: c.prefetch_margin,
            host_cache: c.host_cache,
            // PyTorch's allocator semantics (stream-ordered frees): a job allocating while
            // copies run reuses evicted blocks at once, without waiting for the copies.
            eager_free: true,
        },
        policy,
    ))
}

fn state_code(s: Option<TensorState>) -> TierState {
    match s {
        None => TierState::Unknown,
        Some(TensorState::Resident) => TierState::Resident,
        Some(TensorState::Put) => TierState::Put,
        Some(TensorState::Evicting) => TierState::Evicting,
        Some(TensorState::Evicted) => TierState::Evicted,
        Some(TensorState::Fetching) => TierState::Fetching,
    }
}

fn stats_record(s: &TierStats, policy: &str, cfg: &TierConfig, tensors: usize) -> TierStatsRecord {
    TierStatsRecord {
        creates: s.creates,
        adopts: s.adopts,
        gets: s.gets,
        hits: s.hits,
        misses: s.misses,
        puts: s.puts,
        frees: s.frees,
        evictions: s.evictions,
        rescues: s.rescues,
        prefetches: s.prefetches,
        bytes_to_host: s.bytes_to_host,
        bytes_to_device: s.bytes_to_device,
        waits: s.waits,
        device_bytes: s.device_bytes,
        peak_device_bytes: s.peak_device_bytes,
        host_bytes: s.host_bytes,
        peak_host_bytes: s.peak_host_bytes,
        host_cached_bytes: s.host_cached_bytes,
        host_allocs: s.host_allocs,
        tensors: tensors as u64,
        budget: cfg.device_budget.unwrap_or(0),
        has_budget: cfg.device_budget.is_some(),
        bandwidth: cfg.bandwidth,
        policy: policy.to_string(),
    }
}

impl Gmlake {
    pub(crate) fn new_tier(&self, conf: &TierConf) -> std::result::Result<Box<GmlakeTier>, String> {
        guard("new_tier", || {
            let (cfg, policy) = settings(conf)?;
            Ok(Box::new(GmlakeTier {
                core: Tier::new(Arc::clone(&self.alloc), cfg, policy),
            }))
        })
    }
}

impl GmlakeTier {
    pub(crate) fn create(&self, size: u64, stream: u64) -> std::result::Result<TierFetch, String> {
        guard("tier create", || {
            let (id, ptr) = self.core.create(size, stream).map_err(core_err)?;
            Ok(TierFetch {
                id: id.0,
                ptr,
                hit: true,
            })
        })
    }

    pub(crate) fn adopt(
        &self,
        ptr: u64,
        size: u64,
        stream: u64,
    ) -> std::result::Result<u64, String> {
        guard("tier adopt", || {
            self.core
                .adopt(ptr, size, stream)
                .map(|id| id.0)
                .map_err(core_err)
        })
    }

    pub(crate) fn put(&self, id: u64, next_use: i64) -> std::result::Result<(), String> {
        guard("tier put", || {
            let nu = (next_use >= 0).then_some(next_use as u64);
            self.core.put(TensorId(id), nu).map_err(core_err)
        })
    }

    pub(crate) fn set_next_use(&self, id: u64, next_use: i64) -> std::result::Result<(), String> {
        guard("tier set_next_use", || {
            let nu = (next_use >= 0).then_some(next_use as u64);
            self.core.set_next_use(TensorId(id), nu).map_err(core_err)
        })
    }

    pub(crate) fn offload(&self, id: u64) -> std::result::Result<(), String> {
        guard("tier offload", || {
            self.core.offload(TensorId(id)).map_err(core_err)
        })
    }

    pub(crate) fn relieve(&self, bytes: u64) -> std::result::Result<u64, String> {
        guard("tier relieve", || {
            self.core.relieve(bytes).map_err(core_err)
        })
    }

    pub(crate) fn get(&self, id: u64, stream: u64) -> std::result::Result<TierFetch, String> {
        guard("tier get", || {
            let f = self.core.get(TensorId(id), stream).map_err(core_err)?;
            if let Some((_, s)) = f.event {
                if s != stream {
                    // A copy on another stream: wait for it (no events cross the bridge).
                    self.core.flush().map_err(core_err)?;
                }
            }
            Ok(TierFetch {
                id,
                ptr: f.ptr,
                hit: f.hit,
            })
        })
    }

    pub(crate) fn free(&self, id: u64) -> std::result::Result<(), String> {
        guard("tier free", || {
            self.core.free(TensorId(id)).map_err(core_err)
        })
    }

    pub(crate) fn advance(&self, now: u64) -> std::result::Result<(), String> {
        guard("tier advance", || self.core.advance(now).map_err(core_err))
    }

    pub(crate) fn poll(&self) -> std::result::Result<(), String> {
        guard("tier poll", || self.core.poll().map_err(core_err))
    }

    pub(crate) fn flush(&self) -> std::result::Result<(), String> {
        guard("tier flush", || self.core.flush().map_err(core_err))
    }

    pub(crate) fn trim_host_cache(&self) -> std::result::Result<(), String> {
        guard("tier trim_host_cache", || {
            self.core.trim_host_cache().map_err(core_err)
        })
    }

    pub(crate) fn reconfigure(&self, conf: &TierConf) -> std::result::Result<(), String> {
        guard("tier reconfigure", || {
            let (cfg, policy) = settings(conf)?;
            self.core.reconfigure(cfg, policy).map_err(core_err)
        })
    }

    pub(crate) fn stats(&self) -> TierStatsRecord {
        let s = self.core.stats();
        stats_record(
            &s,
            self.core.policy_name(),
            &self.core.config(),
            self.core.len(),
        )
    }

    pub(crate) fn stats_json(&self) -> String {
        let r = self.stats();
        let nums: [(&str, u64); 23] = [
            ("creates", r.creates),
            ("adopts", r.adopts),
            ("gets", r.gets),
            ("hits", r.hits),
            ("misses", r.misses),
            ("puts", r.puts),
            ("frees", r.frees),
            ("evictions", r.evictions),
            ("rescues", r.rescues),
            ("prefetches", r.prefetches),
            ("bytes_to_host", r.bytes_to_host),
            ("bytes_to_device", r.bytes_to_device),
            ("waits", r.waits),
            ("device_bytes", r.device_bytes),
            ("peak_device_bytes", r.peak_device_bytes),
            ("host_bytes", r.host_bytes),
            ("peak_host_bytes", r.peak_host_bytes),
            ("host_cached_bytes", r.host_cached_bytes),
            ("host_allocs", r.host_allocs),
            ("tensors", r.tensors),
            ("now", self.core.now()),
            ("budget", r.budget),
            ("has_budget", r.has_budget as u64),
        ];
        let mut out = String::from("{");
        for (k, v) in nums {
            out.push_str(&format!("\"{k}\":{v},"));
        }
        out.push_str(&format!(
            "\"bandwidth\":{},\"policy\":\"{}\"}}",
            r.bandwidth, r.policy
        ));
        out
    }

    pub(crate) fn state(&self, id: u64) -> TierState {
        state_code(self.core.state(TensorId(id)))
    }

    /// The bytes the tensor was created or adopted with (0: unknown).
    pub(crate) fn size(&self, id: u64) -> u64 {
        self.core.size(TensorId(id)).unwrap_or(0)
    }

    pub(crate) fn verify(&self) -> std::result::Result<(), String> {
        guard("tier verify", || self.core.verify())
    }
}
