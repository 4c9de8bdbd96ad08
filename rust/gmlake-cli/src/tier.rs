//! `gmlake tier-replay`: replays traces of host-tier operations (`gmlake_core::tier_trace`)
//! with each eviction policy and prints what the tier moved and the memory it saved.

use crate::app::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};
use crate::cli::TierReplayArgs;
use gmlake_core::tier_trace::{self, TierOp, TierReplay};
use gmlake_core::{EvictionPolicy, Lru, SizeLatencyAware};
use std::io::Read;

const MIB: f64 = (1u64 << 20) as f64;

fn policies(which: &str) -> Vec<Box<dyn EvictionPolicy>> {
    let mut v: Vec<Box<dyn EvictionPolicy>> = Vec::new();
    if which != "aware" {
        v.push(Box::new(Lru));
    }
    if which != "lru" {
        v.push(Box::new(SizeLatencyAware::default()));
    }
    v
}

fn read(path: &std::path::Path) -> Result<Vec<TierOp>, String> {
    let mut text = String::new();
    if path.as_os_str() == "-" {
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("standard input: {e}"))?;
    } else {
        text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    tier_trace::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// One output line (table row or JSON object).
fn line(name: &str, json: bool, r: &TierReplay, without: (u64, u64)) -> String {
    let s = &r.stats;
    if json {
        serde_json::json!({
            "trace": name,
            "policy": r.policy,
            "bytes_to_host": s.bytes_to_host,
            "bytes_to_device": s.bytes_to_device,
            "evictions": s.evictions,
            "prefetches": s.prefetches,
            "rescues": s.rescues,
            "gets": s.gets,
            "misses": s.misses,
            "waits": s.waits,
            "peak_tier_device_bytes": s.peak_device_bytes,
            "peak_host_bytes": s.peak_host_bytes,
            "host_allocs": s.host_allocs,
            "peak_reserved": r.peak_reserved,
            "peak_reserved_without_tier": without.0,
            "creates_failed_without_tier": without.1,
            "failed": r.failed,
            "first_error": r.first_error,
        })
        .to_string()
    } else {
        format!(
            "{:<28} {:>6} {:>10.1} {:>10.1} {:>7} {:>8} {:>7}/{:<7} {:>10.1} {:>10.1} {:>6}",
            name,
            r.policy,
            s.bytes_to_host as f64 / MIB,
            s.bytes_to_device as f64 / MIB,
            s.evictions,
            s.prefetches,
            s.misses,
            s.gets,
            r.peak_reserved as f64 / MIB,
            without.0 as f64 / MIB,
            r.failed
        )
    }
}

/// Runs `gmlake tier-replay`; returns the process exit status.
pub fn run_tier_replay(args: &TierReplayArgs) -> i32 {
    let config = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gmlake: {e}");
            return EXIT_USAGE;
        }
    };
    let mut traces: Vec<(String, Result<Vec<TierOp>, String>)> = Vec::new();
    if let Some((layers, steps)) = args.fwd_bwd {
        traces.push((
            format!("fwd-bwd {layers}x{steps}"),
            Ok(tier_trace::forward_backward(layers, steps)),
        ));
    }
    for f in &args.files {
        traces.push((f.display().to_string(), read(f)));
    }
    if !args.json {
        println!(
            "{:<28} {:>6} {:>10} {:>10} {:>7} {:>8} {:>15} {:>10} {:>10} {:>6}",
            "trace",
            "policy",
            "to host",
            "to device",
            "evicts",
            "prefetch",
            "misses/gets",
            "peak res",
            "no tier",
            "failed"
        );
        println!(
            "{:<28} {:>6} {:>10} {:>10} {:>7} {:>8} {:>15} {:>10} {:>10} {:>6}",
            "", "", "MiB", "MiB", "", "", "", "MiB", "MiB", "ops"
        );
    }
    let mut failed = false;
    for (name, ops) in traces {
        let ops = match ops {
            Ok(o) => o,
            Err(e) => {
                eprintln!("gmlake: {e}");
                failed = true;
                continue;
            }
        };
        let without =
            match tier_trace::replay_without_tier(&ops, args.capacity_bytes(), config.clone()) {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("gmlake: {name}: {e}");
                    failed = true;
                    continue;
                }
            };
        for policy in policies(&args.policy) {
            match tier_trace::replay(
                &ops,
                args.capacity_bytes(),
                config.clone(),
                args.tier_config(),
                policy,
            ) {
                Ok(r) => println!("{}", line(&name, args.json, &r, without)),
                Err(e) => {
                    eprintln!("gmlake: {name}: {e}");
                    failed = true;
                }
            }
        }
    }
    if failed {
        EXIT_FAILED
    } else {
        EXIT_OK
    }
}
