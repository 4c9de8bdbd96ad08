//! The command line: `gmlake replay [OPTIONS] FILE...`, `gmlake tier-replay [OPTIONS] FILE...`,
//! `gmlake ops FILE --out FILE`.

use clap::{Args, Parser, Subcommand};
use gmlake_core::{parse_size, Config};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "gmlake",
    version,
    about = "GMLake GPU memory allocator tools",
    propagate_version = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay PyTorch memory snapshots through the allocator on a simulated device and
    /// compare the memory it reserves with what PyTorch's native allocator reserved.
    ///
    /// Each FILE is a pickle written by torch.cuda.memory._dump_snapshot() after
    /// torch.cuda.memory._record_memory_history() (gzip-compressed pickles are accepted).
    /// Every device of every file is replayed separately. No GPU is needed.
    Replay(ReplayArgs),
    /// Replay traces of host-tier operations (create / put / get / free / offload / advance,
    /// one per line; see gmlake_core::tier_trace) through the tier on a simulated device, with
    /// the LRU and the size/latency-aware eviction policies, and report the bytes moved each
    /// way, evictions, prefetches, misses and the peak reserved memory with and without the
    /// tier. No GPU is needed.
    TierReplay(TierReplayArgs),
    /// Write a snapshot's allocations and frees as an operation list: what bench/latency.cpp
    /// (`--ops FILE`) replays through PyTorch's allocators and gmlake on a GPU, to time the
    /// allocator alone on a real job's pattern. Prints what the list holds.
    Ops(OpsArgs),
}

#[derive(Debug, Args)]
pub struct OpsArgs {
    /// The snapshot pickle (gzip-compressed accepted).
    #[arg(value_name = "FILE")]
    pub file: PathBuf,

    /// Where to write the list.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,

    /// The device whose events to take (default: the one with the most events).
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
}

#[derive(Debug, Args)]
pub struct TierReplayArgs {
    /// Tier traces to replay ("-" reads standard input).
    #[arg(required_unless_present = "fwd_bwd", value_name = "FILE")]
    pub files: Vec<PathBuf>,

    /// Replay the synthetic forward/backward job instead: LAYERS,STEPS (e.g. 24,3).
    #[arg(long, value_name = "LAYERS,STEPS", value_parser = parse_pair)]
    pub fwd_bwd: Option<(u64, u64)>,

    /// The most device bytes the tier's tensors may hold (e.g. 20GiB). Default: no budget
    /// (the device's capacity is the only limit).
    #[arg(long, value_name = "SIZE", value_parser = parse_capacity)]
    pub budget: Option<u64>,

    /// Simulate a device of this size. Default: 1 TiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_capacity)]
    pub capacity: Option<u64>,

    /// Eviction policy: lru, aware, or both (default).
    #[arg(long, default_value = "both", value_parser = ["lru", "aware", "both"])]
    pub policy: String,

    /// Host <-> device bandwidth in GB/s (default 25).
    #[arg(long, value_name = "GB/S")]
    pub bandwidth: Option<f64>,

    /// Seconds per unit of the trace's logical clock (default 0.001).
    #[arg(long, value_name = "SECONDS")]
    pub tick: Option<f64>,

    /// Keep up to SIZE of pinned host buffers for reuse (default 0).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub host_cache: Option<u64>,

    /// Set an allocator option, as GMLAKE_CONF would (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_setting)]
    pub settings: Vec<Setting>,

    /// Print one JSON object per (trace, policy) per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_pair(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("expected LAYERS,STEPS, got {s:?}"))?;
    let n = |x: &str| {
        x.trim()
            .parse::<u64>()
            .map_err(|_| format!("expected LAYERS,STEPS, got {s:?}"))
    };
    Ok((n(a)?, n(b)?))
}

impl TierReplayArgs {
    /// The default configuration with every `--set` applied in order.
    pub fn config(&self) -> Result<Config, gmlake_core::Error> {
        let mut config = Config::default();
        for s in &self.settings {
            config.set(&s.key, &s.value)?;
        }
        Ok(config)
    }

    pub fn tier_config(&self) -> gmlake_core::TierConfig {
        let mut t = gmlake_core::TierConfig {
            device_budget: self.budget,
            ..gmlake_core::TierConfig::default()
        };
        if let Some(b) = self.bandwidth {
            t.bandwidth = b * 1e9;
        }
        if let Some(s) = self.tick {
            t.tick_seconds = s;
        }
        if let Some(c) = self.host_cache {
            t.host_cache = c;
        }
        t
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity.unwrap_or(DEFAULT_CAPACITY)
    }
}

/// A default simulated device big enough that no real trace runs out of memory.
pub const DEFAULT_CAPACITY: u64 = 1 << 40;

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Snapshot pickles to replay.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,

    /// Print one JSON object per (trace, device) per line instead of a table.
    #[arg(long)]
    pub json: bool,

    /// Write an SVG chart of active and reserved memory (ours and native) over each trace.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Simulate a device of this size (e.g. 40GiB, 80GB, 1073741824) and report whether
    /// the job fits: allocations that do not fit are counted and skipped. Default: 1 TiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_capacity)]
    pub capacity: Option<u64>,

    /// Set an allocator option, as GMLAKE_CONF would (repeatable), e.g.
    /// --set stitch_strategy=largest_first --set fragLimit=64MiB
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_setting)]
    pub settings: Vec<Setting>,

    /// Treat frees of addresses never allocated, allocations at live addresses and unknown
    /// actions as errors.
    #[arg(long)]
    pub strict: bool,

    /// Only read the traces and report their own figures (peak active, native reserved);
    /// do not replay them through the allocator.
    #[arg(long)]
    pub trace_only: bool,

    /// Free everything at `free_completed`, at once. By default a free whose
    /// `free_completed` comes later than its `free_requested` (record_stream, a buffer of a
    /// collective's stream) is made at the request and waits, on a stream of its own whose
    /// work ends at the completion, as on a GPU: its pages are reusable only then, and the
    /// allocator's events for it are counted.
    #[arg(long)]
    pub instant_frees: bool,

    /// Model the job's side streams (collectives' streams: any but the default stream) as
    /// busy when the allocator looks: an event it records on one (a fence before taking that
    /// stream's freed pages) is still pending within the trace event that recorded it, and
    /// complete at the next. By default every event completes at once, which is right where
    /// those streams are mostly idle (DeepSpeed ZeRO-3 on the GPU) and optimistic where they
    /// always have work queued (FSDP2's prefetched all-gathers): there, a miss that needs
    /// another stream's freed pages makes new memory instead (or, with `cross_stream_wait`,
    /// waits on the device), as on the GPU.
    #[arg(long)]
    pub busy_side_streams: bool,

    /// The page-size upgrade, short for `--set page_upgrade_at=AT --set page_upgrade_size=PAGE`
    /// (e.g. `1GiB:8MiB`): once the allocator holds AT bytes, later allocations get pages of
    /// PAGE bytes, and the memory in the smaller pages goes back to the device as its blocks
    /// are freed. Small jobs keep the configured page; large ones get few driver calls a step.
    /// On by default at 1 GiB, once the job has re-mapped twice what it holds
    /// (`page_upgrade_remap`), to a page sized by the job's large blocks (twice the page, or
    /// four times it where they average 80 MiB or more); `--set page_upgrade_at=off` replays
    /// one page size.
    /// The report says whether the upgrade happened (JSON: `page_upgrade`; table: a note
    /// where it did).
    #[arg(long, value_name = "AT:PAGE", value_parser = parse_upgrade)]
    pub upgrade_pages: Option<(u64, u64)>,

    /// Also report the driver calls by kind in N windows of equal event counts, with the
    /// stitcher's decisions that made them (new stitches and the pages they moved, reuses of
    /// kept ranges, aliases replaced or evicted) (JSON: `driver_calls_windows`; table: one
    /// line per window), to see which steps of a job still call the driver, and why.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub windows: Option<u16>,

    /// Also report where the memory held at the peak sits: live blocks, free blocks after the
    /// last live block of a mapped run (tails of stitched ranges, and how many runs hold one),
    /// before the first, between live blocks, whole free runs, frees pending on other streams,
    /// and pages held unmapped (JSON: `waste_at_peak`; table: a line per device), at the peak
    /// sampled after each event (a peak inside one allocator call, which the reserved figure
    /// also counts, is not seen). Reads a snapshot each time that peak rises.
    #[arg(long)]
    pub waste_at_peak: bool,

    /// Also report the allocations of the trace's second half that took no kept window (each
    /// mapped a new range: the steady state's driver calls), with why: whether a kept window
    /// of the size existed, its busy pages against the most a reuse may replace, and what
    /// held them (live blocks of the same stream or of another, another stream's free blocks
    /// not yet fenced) (JSON: `misses_second_half`, sums and the first 20; table: a note per
    /// device). Costs one more reuse scan at each miss; decisions do not change.
    #[arg(long)]
    pub misses: bool,

    /// Also time every allocation and free the replay asks of the allocator and report
    /// their distribution: count, mean, p50, p90, p99 and max in ns, the total in ms and the
    /// part of it in calls of 1 µs or more (misses, mostly), over all the calls and over the
    /// second half of them, a job's steady state (JSON: `call_times`; table: a note per
    /// device). The median is the hit path's cost; `cpu µs/event` is a mean that misses
    /// dominate. Two clock readings a call; decisions do not change.
    #[arg(long)]
    pub call_times: bool,

    /// Also replay each device with uniform pages of 2, 4, 8, 16 and 32 times the page size
    /// and suggest the largest whose utilization stays within TOLERANCE (default 0.01) of the
    /// replay's own: larger pages mean fewer driver calls (one per page moved), at some
    /// utilization (JSON: `page_size_suggestion`; table: a note with the setting). A tolerance
    /// is given as `--suggest-page-size=0.02`.
    #[arg(long, value_name = "TOLERANCE", num_args = 0..=1, require_equals = true,
          default_missing_value = "0.01",
          value_parser = parse_tolerance)]
    pub suggest_page_size: Option<f64>,

    /// Also replay N copies of each device whose allocations are each a seeded random 0-7
    /// times 512 bytes larger (frees follow), and report the median and range of
    /// utilization and of the second half's driver calls and estimated busy driver time
    /// over the trace and its copies (JSON: `jitter`; table: a note per device). A layout,
    /// hence a peak and a steady state's driver calls, can turn on single placement
    /// decisions: one replay may be far from what nearly the same job gets (the decode
    /// trace: 0.925, each of its copies 0.897), so judge a policy change by the median.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jitter: Option<u16>,
}

fn parse_upgrade(s: &str) -> Result<(u64, u64), String> {
    let (at, page) = s
        .split_once(':')
        .ok_or_else(|| format!("expected AT:PAGE (e.g. 1GiB:8MiB), got {s:?}"))?;
    let at = gmlake_core::parse_size(at).map_err(|e| format!("AT in {s:?}: {e}"))?;
    let page = gmlake_core::parse_size(page).map_err(|e| format!("PAGE in {s:?}: {e}"))?;
    if page == 0 || !page.is_power_of_two() {
        return Err(format!("PAGE in {s:?}: expected a power of two"));
    }
    Ok((at, page))
}

fn parse_tolerance(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if (0.0..1.0).contains(&t) => Ok(t),
        _ => Err(format!(
            "expected a utilization tolerance in [0, 1), got {s:?}"
        )),
    }
}

/// One `--set KEY=VALUE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub key: String,
    pub value: String,
}

fn parse_capacity(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err("the capacity must be more than 0 bytes".into()),
        n => Ok(n),
    }
}

/// Splits `KEY=VALUE` and checks it with the allocator's own configuration parser, so an
/// invalid setting is rejected with the core's message before anything is read.
fn parse_setting(s: &str) -> Result<Setting, String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    let (key, value) = (key.trim(), value.trim());
    Config::default()
        .set(key, value)
        .map_err(|e| e.to_string())?;
    Ok(Setting {
        key: key.to_string(),
        value: value.to_string(),
    })
}

impl ReplayArgs {
    /// The default configuration with every `--set` applied in order.
    pub fn config(&self) -> Result<Config, gmlake_core::Error> {
        let mut config = Config::default();
        for s in &self.settings {
            config.set(&s.key, &s.value)?;
        }
        if let Some((at, page)) = self.upgrade_pages {
            config.page_upgrade_at = Some(at);
            config.page_upgrade_size = page;
        }
        Ok(config)
    }

    /// The simulated device's size.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity.unwrap_or(DEFAULT_CAPACITY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_replay_options() {
        let cli = Cli::try_parse_from([
            "gmlake",
            "replay",
            "a.pickle",
            "b.pickle.gz",
            "--json",
            "--capacity",
            "40GiB",
            "--set",
            "fragLimit=64MiB",
            "--set",
            "stitch_strategy=lru",
            "--strict",
        ])
        .unwrap();
        let Command::Replay(r) = cli.command else {
            panic!("not replay")
        };
        assert_eq!(r.files.len(), 2);
        assert!(r.json && r.strict && !r.trace_only);
        assert_eq!(r.capacity_bytes(), 40 << 30);
        let c = r.config().unwrap();
        assert_eq!(c.frag_limit, 64 << 20);
        assert_eq!(c.stitch_strategy, gmlake_core::StitchStrategy::Lru);
    }

    #[test]
    fn parses_tier_replay_options() {
        let cli = Cli::try_parse_from([
            "gmlake",
            "tier-replay",
            "--fwd-bwd",
            "24,3",
            "--budget",
            "56MiB",
            "--policy",
            "aware",
            "--bandwidth",
            "50",
        ])
        .unwrap();
        let Command::TierReplay(r) = cli.command else {
            panic!("not tier-replay")
        };
        assert_eq!(r.fwd_bwd, Some((24, 3)));
        assert_eq!(r.policy, "aware");
        let t = r.tier_config();
        assert_eq!(t.device_budget, Some(56 << 20));
        assert_eq!(t.bandwidth, 50e9);
        assert!(Cli::try_parse_from(["gmlake", "tier-replay"]).is_err());
        assert!(Cli::try_parse_from(["gmlake", "tier-replay", "a", "--policy", "mru"]).is_err());
        assert!(Cli::try_parse_from(["gmlake", "tier-replay", "--fwd-bwd", "3"]).is_err());
    }

    #[test]
    fn rejects_bad_values_with_the_cores_message() {
        let e = Cli::try_parse_from(["gmlake", "replay", "a", "--set", "defragLevel=high"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("defragLevel") && e.contains("high"), "{e}");
        let e = Cli::try_parse_from(["gmlake", "replay", "a", "--set", "fragLimit"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("KEY=VALUE"), "{e}");
        let e = Cli::try_parse_from(["gmlake", "replay", "a", "--capacity", "12 parsecs"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("parsecs"), "{e}");
        assert!(
            Cli::try_parse_from(["gmlake", "replay"]).is_err(),
            "FILE is required"
        );
        let r = Cli::try_parse_from(["gmlake", "replay", "a"]).unwrap();
        let Command::Replay(r) = r.command else {
            panic!("not replay")
        };
        assert_eq!(r.capacity_bytes(), DEFAULT_CAPACITY);
    }
}
