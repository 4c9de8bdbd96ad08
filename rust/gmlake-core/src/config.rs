//! Configuration: GMLake's environment variables with their meanings, plus one `GMLAKE_CONF`
//! list of `key:value` pairs in the style of `PYTORCH_CUDA_ALLOC_CONF`.
//!
//! Precedence: defaults, then GMLake's variables (`vmmDefragment`, `fragLimit`, `reuseLimit`,
//! `defragLevel`, `autoGC`), then `GMLAKE_CONF`, then explicit [`Config::set`] calls. Every
//! rejected value is an [`Error::InvalidConfig`] naming the variable and the value.

use crate::error::{Error, Result};

/// How the pages for a stitch are chosen among cached free blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StitchStrategy {
    /// Smallest cached block that covers the whole shortfall; otherwise the largest blocks
    /// first, so a stitch takes as few pieces as possible and leaves larger blocks whole.
    BestFit,
    /// GMLake's choice: the largest cached free blocks first.
    LargestFirst,
    /// The least recently freed cached blocks first.
    Lru,
}

impl StitchStrategy {
    pub fn name(self) -> &'static str {
        match self {
            StitchStrategy::BestFit => "best_fit",
            StitchStrategy::LargestFirst => "largest_first",
            StitchStrategy::Lru => "lru",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `vmmDefragment`: stitch free pages into new ranges. Off: a request that no cached block
    /// fits always gets new physical memory (cached pages are returned only on OOM).
    pub vmm_defragment: bool,
    /// `fragLimit`: stitch only for requests of at least this many bytes.
    pub frag_limit: u64,
    /// `reuseLimit`: reuse a cached free block directly only if its size is at most
    /// request x reuseLimit; larger blocks are drawn on page by page. `inf` disables the check.
    pub reuse_limit: f64,
    /// `defragLevel`: 0 stitch before creating physical memory; 1 only after creating failed;
    /// 2 only after returning cached memory and retrying failed; >= 5 never.
    pub defrag_level: u32,
    /// `autoGC` (GiB): after a stitch, if more than this many bytes sit cached in free mapped
    /// blocks, return the least recently used cached pages to the device until below it.
    pub auto_gc_bytes: Option<u64>,
    /// `stitch_strategy`: best_fit (default), largest_first (GMLake), lru.
    pub stitch_strategy: StitchStrategy,
    /// `page_size`: physical page size; 0 means the device's granularity. Must be a multiple
    /// of the granularity.
    pub page_size: u64,
    /// `small_size`: requests up to this many bytes go to the small pool (PyTorch: 1 MiB).
    pub small_size: u64,
    /// `memory_fraction`: cap reserved memory at this fraction of the device (0 <= f <= 1; 0
    /// allows nothing, as PyTorch's).
    pub memory_fraction: Option<f64>,
    /// `limit`: cap reserved memory at this many bytes.
    pub limit_bytes: Option<u64>,
    /// `max_aliases`: how many old mappings of stitched pages are kept for reuse, as a
    /// multiple of the pages held (at least `alias_floor` worth of pages when not 0). Kept mappings
    /// cost virtual addresses only, and let a periodic job reuse last step's stitched ranges
    /// with no driver call; beyond the bound the oldest are unmapped. 0 unmaps every old
    /// mapping once its stream is done with it.
    pub max_aliases: f64,
    /// `alias_floor`: kept aliases a job may always have, in bytes of pages, whatever
    /// `max_aliases` allows in proportion to its size (default 128 GiB). An alias costs
    /// virtual addresses and a page-table entry, not memory; small jobs whose shapes vary
    /// stitch a window for most sizes they meet, and evicting those aliases made them stitch
    /// the same windows again at every step.
    pub alias_floor: u64,
    /// `replace_min_pages`: a kept window of fewer pages than this is reused only when none
    /// of its lent pages is busy; larger windows may have up to a quarter of their pages
    /// busy, each unmapped and refilled (default 8; 0 or 1: any window, at least one busy
    /// page, the rule before). In a small window one busy page is a large share, and taking
    /// it packed growing blocks into other runs' tails: the concatenation trace held 0.922
    /// (0.913-0.928 over jittered copies), 0.961 (0.953-0.965) without it, every other
    /// bundled trace unchanged within its copies' spread (docs/design.md, "Small windows").
    pub replace_min_pages: u64,
    /// `stitch_tails_last` (on by default): a stitch takes pages from free blocks right after
    /// a live block (a run's tail, where its next, slightly larger block would go as a hit)
    /// only when no other free block will do. On an H200 the concatenation job over 60 steps
    /// made no driver call from its third step to its 44th with it, at utilization 0.947,
    /// against calls in most steps (466 a step on average) at 0.928 without it, as the replay
    /// of that run's trace predicts to the call; over jittered copies of the bundled traces
    /// the other jobs' utilization stays within 0.003 (docs/design.md, "Stitch sources: tails
    /// last").
    pub stitch_tails_last: bool,
    /// `roundup_power2_divisions` (PyTorch's key and syntax): requests are rounded up to the
    /// next of N equal divisions of their power-of-two interval instead of to 512 bytes. One
    /// entry per interval, [1 MiB, 2 MiB) first and [32 GiB, ...) last (sizes below 1 MiB use
    /// the first); 0 or 1: no rounding beyond 512 bytes.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `debug`, `debug_quarantine`, `debug_guard_min`, `debug_canary_bytes`: the memory
    /// debugging mode (off by default; see [`crate::debug`]).
    pub debug: crate::debug::DebugConfig,
    /// `util_target`: when a miss needs pages, create new memory before stitching as long as
    /// the pages held stay within (active bytes + the request) / util_target; stitch beyond
    /// that. Trades a bounded share of utilization for fewer driver calls where lifetimes
    /// are random (a stitch maps every page it moves, on every miss). None (`off`, the
    /// default): stitch first, as `defragLevel` says.
    pub util_target: Option<f64>,
    /// `cross_stream_wait`: when a miss on stream S needs pages that only free blocks of
    /// another stream T hold, and T's fence has not completed, make S wait on the device for an
    /// event recorded on T now (`cuStreamWaitEvent`) and take those pages, instead of creating
    /// new memory. The host never blocks; S's later work runs after T's earlier work, which it
    /// usually waits for anyway (collectives' outputs). On by default: without it a stream
    /// that always has work queued (FSDP2's all-gather stream) costs new memory at every such
    /// miss (FSDP2 on two H200s: 0.94 utilization without, 0.99 with, same step time).
    pub cross_stream_wait: bool,
    /// `wait_to_reuse` (off by default; needs `cross_stream_wait`): a miss that finds no kept
    /// window to reuse, and whose stitch is going to wait on the device for other streams
    /// anyway (the pages it may take at once fall short), first asks whether a window of its
    /// arena would be free after that wait with no busy page; if so it waits and takes the
    /// window as it is instead of mapping a new range from those same pages. Measured in the
    /// replay only (docs/design.md, "Open: jobs whose shapes change every step").
    pub wait_to_reuse: bool,
    /// `reuse_fenced_blocks` (off by default): a kept-window scan counts the pages of another
    /// stream's free block as free when that block's own free is behind a completed fence of
    /// its stream, not only when the stream's last free is; a scan that finds nothing brings
    /// the fences up to date (an event query, and a record where none is pending) and looks
    /// again. For the periodic kept windows of side streams whose pages rest in the main
    /// stream's blocks between steps (the main stream frees all the time, so its last free is
    /// never fenced when a side stream asks). ZeRO-3 on four H200s, rank 0's VMM calls a step
    /// after warm-up: N 127-202 -> 0 (after its first measured step), LR 133 -> 47 (median);
    /// but FSDP2 on two H200s makes twice the driver calls (127-160 a step against 65-77) at
    /// no gain in utilization, as the replay said: hence off.
    /// docs/design.md, "Reusing windows whose pages rest on another stream".
    pub reuse_fenced_blocks: bool,
    /// `host_timing`: the bridge to PyTorch (gmlake-ffi) times every allocation and free that
    /// PyTorch's allocator interface passes to the core (lock, bookkeeping, driver calls; not
    /// the host tier's own, nor blocks placed at a given address for IPC), and reports the
    /// totals in
    /// `memory_stats()` as `gmlake.host_ns_alloc`, `gmlake.host_ns_free` and the calls timed,
    /// `gmlake.host_calls_alloc` and `gmlake.host_calls_free`: the allocator's own share of a
    /// step, read in the job itself; and keeps the last 65,536 calls that took 50 µs or more
    /// with their start (`gmlake.snapshot()["slow_calls"]`), to place them on a profiler's
    /// timeline. Off by default: two clock readings a call (about 40 ns). The core does not
    /// read it.
    pub host_timing: bool,
    /// `page_upgrade_at`: once the allocator holds this many bytes (and has re-mapped as
    /// much, `page_upgrade_remap`), later allocations get pages of `page_upgrade_size`
    /// instead of `page_size`, and the memory held in the smaller pages goes back to the
    /// device as its blocks are freed (it drains into the larger pages). A job that stays
    /// below it, or that reaches a steady state with no driver calls, keeps the small page
    /// (the utilization small jobs need); one that keeps re-mapping pays half the driver calls
    /// a step after the upgrade. Default 1 GiB (measured on the GPU, docs/benchmarks.md);
    /// `off`: one page size throughout. The memory debugging mode turns it off.
    pub page_upgrade_at: Option<u64>,
    /// `page_upgrade_size`: the page size after the upgrade; 0 (the default): chosen at the
    /// upgrade from the job's large blocks, a tenth of their mean size when they were at
    /// their highest, from twice to four times the first page (`allocator/upgrade.rs`,
    /// `auto_page`). Otherwise a power of two larger than the first page size and a multiple
    /// of the device's granularity.
    pub page_upgrade_size: u64,
    /// `page_upgrade_remap`: once the allocator holds `page_upgrade_at`, the upgrade waits
    /// until the pages it has mapped again since (stitched or replaced, not reused) add up
    /// to this multiple of the memory it holds (default 2; 0: at once). A rent-or-buy rule:
    /// the upgrade gives back what is held (an unmap per mapping, a release per page) and
    /// creates it again (a create and a map per larger page), about twice what re-mapping
    /// it once costs, so it is bought once that much has been paid in re-mapping. A job
    /// with a steady state (no driver calls once warm) never pays it and keeps its pages and
    /// its utilization; a short run with no steady state does not switch late for nothing.
    pub page_upgrade_remap: f64,
    /// `driver_share_notice`: once the allocator's driver calls have taken at least this
    /// share of the wall time in two windows of `DRIVER_SHARE_WINDOW` in a row (5 s each), it
    /// says so once, with the settings that trade utilization for fewer calls
    /// (`Allocator::take_notices`; the bridge prints it). Such a job has no steady state: its
    /// allocations' lifetimes do not repeat, so stitched ranges are rarely reused and every
    /// miss maps pages (on an H100 the random mixed pattern of bench/latency.cpp spends about
    /// 60% of its time in them at the defaults, the random-lifetime stress pattern over 90%;
    /// a training job with a steady state, none after its first steps). Default 0.25; `off`
    /// (or 0) never tells, nor upgrades. The notice itself decides nothing;
    /// `driver_share_upgrade` acts at the same moment.
    pub driver_share_notice: Option<f64>,
    /// `driver_share_upgrade` (on by default): when the driver-share watch tells, new memory
    /// also gets pages twice as large at once, and the smaller pages go back to the device as
    /// their blocks are freed (a page-size upgrade, `allocator/upgrade.rs`, after or instead
    /// of the rent-or-buy one). A job that keeps paying at the new page doubles it again after
    /// two more windows, up to the page near its mean large tensor (the largest power of two
    /// at most its mean, 8-128 MiB): it ends at the smallest page that brings its share under
    /// the threshold, or at that cap. Not with `page_upgrade_at:off` (one page size) nor in
    /// debug mode.
    pub driver_share_upgrade: bool,
}

/// `driver_share_notice`'s default: a quarter of the wall time.
pub const DEFAULT_DRIVER_SHARE_NOTICE: f64 = 0.25;

/// `page_upgrade_at`'s default: 1 GiB. With the default rent-or-buy rule only jobs that
/// keep re-mapping upgrade; on the GPU (four H200s, 2026-11-27) those kept 0.976-0.992
/// utilization and made 2-3x fewer maps a step (docs/benchmarks.md).
pub const DEFAULT_PAGE_UPGRADE_AT: u64 = 1 << 30;

/// Intervals of `roundup_power2_divisions`, as PyTorch's (1 MiB to 64 GiB).
pub const ROUNDUP_INTERVALS: usize = 16;

impl Default for Config {
    fn default() -> Self {
        Config {
            vmm_defragment: true,
            frag_limit: 0,
            reuse_limit: f64::INFINITY,
            defrag_level: 0,
            auto_gc_bytes: None,
            stitch_strategy: StitchStrategy::BestFit,
            page_size: 0,
            small_size: 1 << 20,
            memory_fraction: None,
            limit_bytes: None,
            max_aliases: 4.0,
            alias_floor: 128 << 30,
            replace_min_pages: DEFAULT_REPLACE_MIN_PAGES,
            stitch_tails_last: true,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            debug: crate::debug::DebugConfig::default(),
            util_target: None,
            cross_stream_wait: true,
            wait_to_reuse: false,
            reuse_fenced_blocks: false,
            host_timing: false,
            page_upgrade_at: Some(DEFAULT_PAGE_UPGRADE_AT),
            page_upgrade_size: 0,
            page_upgrade_remap: 2.0,
            driver_share_notice: Some(DEFAULT_DRIVER_SHARE_NOTICE),
            driver_share_upgrade: true,
        }
    }
}

/// `replace_min_pages`' default: windows under 8 pages replace no busy alias.
pub const DEFAULT_REPLACE_MIN_PAGES: u64 = 8;

/// The keys [`Config::set`] accepts, with GMLake's spellings first.
pub const CONFIG_KEYS: &[&str] = &[
    "vmmDefragment",
    "fragLimit",
    "reuseLimit",
    "defragLevel",
    "autoGC",
    "stitch_strategy",
    "page_size",
    "small_size",
    "memory_fraction",
    "limit",
    "max_aliases",
    "alias_floor",
    "replace_min_pages",
    "stitch_tails_last",
    "roundup_power2_divisions",
    "debug",
    "debug_quarantine",
    "debug_guard_min",
    "debug_canary_bytes",
    "util_target",
    "cross_stream_wait",
    "wait_to_reuse",
    "reuse_fenced_blocks",
    "host_timing",
    "page_upgrade_at",
    "page_upgrade_size",
    "page_upgrade_remap",
    "driver_share_notice",
    "driver_share_upgrade",
];

/// GMLake's environment variables, read by [`Config::from_env`].
pub const GMLAKE_ENV_VARS: &[&str] = &[
    "vmmDefragment",
    "fragLimit",
    "reuseLimit",
    "defragLevel",
    "autoGC",
];

fn invalid(key: &str, value: &str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Parses a byte count: a plain integer or a number with a unit (B, KB, KiB, MB, MiB, GB, GiB,
/// TB, TiB; as in PyTorch, KB/MB/GB are binary units). Fractions are allowed with a unit.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    if num.is_empty() {
        return Err("expected a number of bytes such as 1073741824 or 40GiB".into());
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown unit {other:?}")),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| "size overflows 64 bits".to_string());
    }
    let f: f64 = num
        .parse()
        .map_err(|_| format!("{num:?} is not a number"))?;
    let bytes = f * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err("size out of range".into());
    }
    Ok(bytes.round() as u64)
}

/// A finite number >= 0 (`max_aliases`, `page_upgrade_remap`).
fn parse_non_negative(key: &str, value: &str) -> Result<f64> {
    let f: f64 = value
        .trim()
        .parse()
        .map_err(|_| invalid(key, value, "expected a number >= 0"))?;
    if !(f >= 0.0 && f.is_finite()) {
        return Err(invalid(key, value, "expected a finite number >= 0"));
    }
    Ok(f)
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        v => match v.parse::<i64>() {
            // GMLake reads vmmDefragment as an integer: > 0 is on.
            Ok(n) => Ok(n > 0),
            Err(_) => Err(invalid(key, value, "expected 1/0, true/false or on/off")),
        },
    }
}

/// PyTorch's `round_size`: at least 512 bytes; with `divisions` > 1 and a size above 512 x
/// divisions, the next of `divisions` equal steps between the size's power of two and the
/// next; else the next multiple of 512.
pub fn round_size_with(size: u64, divisions: u64) -> u64 {
    const MIN: u64 = 512;
    if size < MIN {
        return MIN;
    }
    if divisions > 1 && size > MIN * divisions {
        if size.is_power_of_two() {
            return size;
        }
        let floor = 1u64 << (63 - size.leading_zeros());
        let step = floor >> (63 - divisions.leading_zeros());
        if step == 0 {
            return floor << 1;
        }
        let rounded = size & !(step - 1);
        return if rounded == size {
            size
        } else {
            rounded + step
        };
    }
    size.div_ceil(MIN) * MIN
}

/// Splits `key:value,key:value` at the commas outside brackets (a value may be a list such
/// as `[64:8,256:4,>:1]`).
fn split_items(conf: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in conf.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth <= 0 => {
                out.push(&conf[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&conf[start..]);
    out
}

/// PyTorch's `roundup_power2_divisions`: one number of divisions for every size, or a list
/// `[boundary_MiB:divisions,...,>:divisions]` (boundaries and divisions powers of two; a
/// division of 0 turns rounding off for its intervals).
fn parse_roundup(key: &str, value: &str) -> Result<[u64; ROUNDUP_INTERVALS]> {
    let v = value.trim();
    let bad = |r: &str| invalid(key, value, r.to_string());
    let mut out = [0u64; ROUNDUP_INTERVALS];
    let Some(inner) = v.strip_prefix('[') else {
        let n: u64 = v
            .parse()
            .map_err(|_| bad("expected a power of two or a list such as [64:8,256:4,>:1]"))?;
        if !n.is_power_of_two() {
            return Err(bad("the divisions have to be a power of two"));
        }
        return Ok([n; ROUNDUP_INTERVALS]);
    };
    let inner = inner
        .strip_suffix(']')
        .ok_or_else(|| bad("a list must end with ]"))?;
    let mut last = 0usize;
    for item in inner.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (b, d) = item
            .split_once(':')
            .ok_or_else(|| bad("expected boundary:divisions in the list"))?;
        let d: u64 = d
            .trim()
            .parse()
            .map_err(|_| bad("divisions must be an integer"))?;
        if d != 0 && !d.is_power_of_two() {
            return Err(bad("the divisions have to be a power of two or 0"));
        }
        if b.trim() == ">" {
            for e in out.iter_mut().skip(last + 1) {
                *e = d;
            }
            continue;
        }
        let b: u64 = b
            .trim()
            .parse()
            .map_err(|_| bad("a boundary must be an integer (MiB) or >"))?;
        if !b.is_power_of_two() {
            return Err(bad(
                "the interval boundaries have to be powers of two (MiB)",
            ));
        }
        // As PyTorch: the entries up to the boundary's own interval, inclusive.
        let index = (b.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        let from = if last == 0 { 0 } else { last + 1 };
        for e in out.iter_mut().take(index + 1).skip(from) {
            *e = d;
        }
        last = index;
    }
    Ok(out)
}

impl Config {
    /// The divisions of `roundup_power2_divisions` for a request of `size` bytes.
    pub fn roundup_divisions(&self, size: u64) -> u64 {
        let log = 63 - size.max(1).leading_zeros() as usize;
        let index = log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1);
        self.roundup_power2_divisions[index]
    }

    /// A request's size as the allocator places it: 512-byte multiples, or PyTorch's
    /// power-of-two divisions where `roundup_power2_divisions` asks for them.
    pub fn round_size(&self, size: u64) -> u64 {
        round_size_with(size, self.roundup_divisions(size))
    }

    /// Sets one key (GMLake's names, or this project's snake_case names; case-insensitive).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        // The memory debugging mode's keys (`debug*`), in their own module.
        if self.debug.set(key, value)? {
            return Ok(());
        }
        let v = value.trim();
        let size = |k: &str| parse_size(v).map_err(|r| invalid(k, value, r));
        match key.trim().to_ascii_lowercase().as_str() {
            "vmmdefragment" | "vmm_defragment" => self.vmm_defragment = parse_bool(key, v)?,
            "fraglimit" | "frag_limit" => self.frag_limit = size(key)?,
            "reuselimit" | "reuse_limit" => {
                let f: f64 = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected a number >= 1 or inf"))?;
                if f.is_nan() || f < 1.0 {
                    return Err(invalid(key, value, "expected a number >= 1 or inf"));
                }
                self.reuse_limit = f;
            }
            "defraglevel" | "defrag_level" => {
                self.defrag_level = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected an integer >= 0"))?
            }
            "autogc" | "auto_gc" => {
                let g: f64 = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected a number of GiB >= 0"))?;
                if g.is_nan() || g < 0.0 {
                    return Err(invalid(key, value, "expected a number of GiB >= 0"));
                }
                self.auto_gc_bytes = if g.is_infinite() {
                    None
                } else {
                    Some((g * (1u64 << 30) as f64) as u64)
                };
            }
            "stitch_strategy" | "stitchstrategy" => {
                self.stitch_strategy = match v.to_ascii_lowercase().replace('-', "_").as_str() {
                    "best_fit" | "bestfit" => StitchStrategy::BestFit,
                    "largest_first" | "largest" | "gmlake" => StitchStrategy::LargestFirst,
                    "lru" => StitchStrategy::Lru,
                    _ => {
                        return Err(invalid(
                            key,
                            value,
                            "expected best_fit, largest_first or lru",
                        ))
                    }
                }
            }
            "page_size" | "pagesize" => {
                let p = size(key)?;
                if p != 0 && !p.is_power_of_two() {
                    return Err(invalid(key, value, "expected 0 or a power of two"));
                }
                self.page_size = p;
            }
            "page_upgrade_at" | "pageupgradeat" => {
                self.page_upgrade_at = match v.to_ascii_lowercase().as_str() {
                    "off" | "none" | "0" => None,
                    _ => match size(key)? {
                        0 => None,
                        b => Some(b),
                    },
                };
            }
            "page_upgrade_size" | "pageupgradesize" => {
                let p = size(key)?;
                if p != 0 && !p.is_power_of_two() {
                    return Err(invalid(
                        key,
                        value,
                        "expected 0 (sized by the job's blocks) or a power of two",
                    ));
                }
                self.page_upgrade_size = p;
            }
            "page_upgrade_remap" | "pageupgraderemap" => {
                self.page_upgrade_remap = parse_non_negative(key, value)?
            }
            "max_aliases" | "maxaliases" => self.max_aliases = parse_non_negative(key, value)?,
            "util_target" | "utiltarget" => {
                let why = "expected a fraction in (0, 1] or off";
                self.util_target = match v.to_ascii_lowercase().as_str() {
                    "off" | "none" => None,
                    _ => {
                        let f: f64 = v.parse().map_err(|_| invalid(key, value, why))?;
                        if !(f > 0.0 && f <= 1.0) {
                            return Err(invalid(key, value, why));
                        }
                        Some(f)
                    }
                };
            }
            "cross_stream_wait" | "crossstreamwait" => self.cross_stream_wait = parse_bool(key, v)?,
            "wait_to_reuse" | "waittoreuse" => self.wait_to_reuse = parse_bool(key, v)?,
            "reuse_fenced_blocks" | "reusefencedblocks" => {
                self.reuse_fenced_blocks = parse_bool(key, v)?
            }
            "host_timing" | "hosttiming" => self.host_timing = parse_bool(key, v)?,
            "driver_share_upgrade" | "drivershareupgrade" => {
                self.driver_share_upgrade = parse_bool(key, v)?
            }
            "driver_share_notice" | "driversharenotice" => {
                let why = "expected a share of the wall time in (0, 1], or off";
                self.driver_share_notice = match v.to_ascii_lowercase().as_str() {
                    "off" | "none" | "0" => None,
                    _ => {
                        let f: f64 = v.parse().map_err(|_| invalid(key, value, why))?;
                        if !(f > 0.0 && f <= 1.0) {
                            return Err(invalid(key, value, why));
                        }
                        Some(f)
                    }
                };
            }
            "small_size" | "smallsize" => {
                let s = size(key)?;
                if s == 0 || s > 1 << 30 {
                    return Err(invalid(key, value, "expected 1 byte to 1 GiB"));
                }
                self.small_size = s;
            }
            "memory_fraction" | "memoryfraction" | "fraction" => {
                let f: f64 = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected a fraction in [0, 1]"))?;
                if !(0.0..=1.0).contains(&f) {
                    return Err(invalid(key, value, "expected a fraction in [0, 1]"));
                }
                self.memory_fraction = Some(f);
            }
            "roundup_power2_divisions" | "roundup" => {
                self.roundup_power2_divisions = parse_roundup(key, value)?;
            }
            "alias_floor" | "aliasfloor" => self.alias_floor = size(key)?,
            "stitch_tails_last" | "stitchtailslast" => self.stitch_tails_last = parse_bool(key, v)?,
            "replace_min_pages" | "replaceminpages" => {
                self.replace_min_pages = v
                    .parse::<u64>()
                    .map_err(|_| invalid(key, value, "expected a whole number of pages"))?
            }
            "limit" | "limit_bytes" => {
                let l = size(key)?;
                self.limit_bytes = if l == 0 { None } else { Some(l) };
            }
            _ => {
                return Err(invalid(
                    key,
                    value,
                    format!("unknown key; known keys: {}", CONFIG_KEYS.join(", ")),
                ))
            }
        }
        Ok(())
    }

    /// Applies a `key:value,key:value` list (`=` is accepted in place of `:`).
    pub fn apply_conf(&mut self, conf: &str) -> Result<()> {
        for item in split_items(conf)
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
        {
            let (k, v) = item
                .split_once(':')
                .or_else(|| item.split_once('='))
                .ok_or_else(|| invalid("GMLAKE_CONF", item, "expected key:value"))?;
            self.set(k, v)?;
        }
        Ok(())
    }

    /// Defaults overridden by GMLake's variables and then `GMLAKE_CONF`, read through `get`
    /// (so tests need not touch the process environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        for var in GMLAKE_ENV_VARS {
            if let Some(v) = get(var) {
                if !v.trim().is_empty() {
                    c.set(var, &v)?;
                }
            }
        }
        if let Some(conf) = get("GMLAKE_CONF") {
            c.apply_conf(&conf)?;
        }
        Ok(c)
    }

    /// [`Config::from_lookup`] over the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Whether a request of `size` bytes may be served by stitching.
    pub(crate) fn may_stitch(&self, size: u64) -> bool {
        self.vmm_defragment && self.defrag_level < 5 && size >= self.frag_limit
    }

    /// The configuration as `key:value` pairs, for snapshots' config metadata.
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        let opt = |o: Option<u64>| o.map_or("none".to_string(), |v| v.to_string());
        vec![
            ("vmmDefragment", (self.vmm_defragment as u8).to_string()),
            ("fragLimit", self.frag_limit.to_string()),
            ("reuseLimit", self.reuse_limit.to_string()),
            ("defragLevel", self.defrag_level.to_string()),
            (
                "autoGC",
                self.auto_gc_bytes.map_or("inf".to_string(), |b| {
                    (b as f64 / (1u64 << 30) as f64).to_string()
                }),
            ),
            ("stitch_strategy", self.stitch_strategy.name().to_string()),
            ("page_size", self.page_size.to_string()),
            ("small_size", self.small_size.to_string()),
            ("max_aliases", self.max_aliases.to_string()),
            ("alias_floor", self.alias_floor.to_string()),
            ("replace_min_pages", self.replace_min_pages.to_string()),
            (
                "stitch_tails_last",
                (self.stitch_tails_last as u8).to_string(),
            ),
            (
                "util_target",
                self.util_target
                    .map_or("off".to_string(), |f| f.to_string()),
            ),
            (
                "cross_stream_wait",
                (self.cross_stream_wait as u8).to_string(),
            ),
            ("wait_to_reuse", (self.wait_to_reuse as u8).to_string()),
            (
                "reuse_fenced_blocks",
                (self.reuse_fenced_blocks as u8).to_string(),
            ),
            ("host_timing", (self.host_timing as u8).to_string()),
            (
                "page_upgrade_at",
                self.page_upgrade_at
                    .map_or("off".to_string(), |b| b.to_string()),
            ),
            ("page_upgrade_size", self.page_upgrade_size.to_string()),
            ("page_upgrade_remap", self.page_upgrade_remap.to_string()),
            (
                "driver_share_notice",
                self.driver_share_notice
                    .map_or("off".to_string(), |f| f.to_string()),
            ),
            (
                "driver_share_upgrade",
                (self.driver_share_upgrade as u8).to_string(),
            ),
            (
                "memory_fraction",
                self.memory_fraction
                    .map_or("none".to_string(), |f| f.to_string()),
            ),
            ("limit", opt(self.limit_bytes)),
            (
                "roundup_power2_divisions",
                roundup_text(&self.roundup_power2_divisions),
            ),
        ]
        .into_iter()
        .chain(self.debug.to_pairs())
        .collect()
    }
}

/// `roundup_power2_divisions` in PyTorch's syntax: one number when every interval has the
/// same, else `[1:a,2:b,...,32768:p]` (one boundary in MiB per interval).
fn roundup_text(d: &[u64; ROUNDUP_INTERVALS]) -> String {
    if d.iter().all(|&x| x == d[0]) {
        return d[0].to_string();
    }
    let parts: Vec<String> = d
        .iter()
        .enumerate()
        .map(|(i, &x)| format!("{}:{x}", 1u64 << i))
        .collect();
    format!("[{}]", parts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size("40GiB"), Ok(40 << 30));
        assert_eq!(parse_size("512MB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn gmlake_variables_then_conf() {
        let env = |k: &str| match k {
            "vmmDefragment" => Some("1".to_string()),
            "fragLimit" => Some("1073741824".to_string()),
            "reuseLimit" => Some("10".to_string()),
            "defragLevel" => Some("1".to_string()),
            "autoGC" => Some("80".to_string()),
            "GMLAKE_CONF" => Some("stitch_strategy:largest_first, fragLimit:2MiB".to_string()),
            _ => None,
        };
        let c = Config::from_lookup(env).unwrap();
        assert!(c.vmm_defragment);
        assert_eq!(c.frag_limit, 2 << 20, "GMLAKE_CONF overrides the variable");
        assert_eq!(c.reuse_limit, 10.0);
        assert_eq!(c.defrag_level, 1);
        assert_eq!(c.auto_gc_bytes, Some(80 << 30));
        assert_eq!(c.stitch_strategy, StitchStrategy::LargestFirst);
    }

    #[test]
    fn invalid_values_name_the_variable_and_value() {
        let env = |k: &str| (k == "defragLevel").then(|| "high".to_string());
        match Config::from_lookup(env) {
            Err(Error::InvalidConfig { key, value, .. }) => {
                assert_eq!(key, "defragLevel");
                assert_eq!(value, "high");
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
        let mut c = Config::default();
        let e = c.set("reuseLimit", "0.5").unwrap_err();
        assert!(e.to_string().contains("reuseLimit") && e.to_string().contains("0.5"));
        assert!(c.apply_conf("fragLimit").is_err());
        assert!(c
            .set("nonsense", "1")
            .unwrap_err()
            .to_string()
            .contains("nonsense"));
        assert!(c.set("memory_fraction", "1.5").is_err());
        assert!(c.set("page_size", "3MiB").is_err());
        assert_eq!(c.page_upgrade_at, Some(DEFAULT_PAGE_UPGRADE_AT));
        assert_eq!(c.page_upgrade_size, 0);
        c.set("page_upgrade_at", "off").unwrap();
        assert_eq!(c.page_upgrade_at, None);
        c.set("page_upgrade_at", "2GiB").unwrap();
        assert_eq!(c.page_upgrade_at, Some(2 << 30));
        c.set("page_upgrade_size", "16MiB").unwrap();
        assert_eq!(c.page_upgrade_size, 16 << 20);
        let e = c.set("page_upgrade_size", "12MiB").unwrap_err();
        assert!(e.to_string().contains("page_upgrade_size"), "{e}");
        let e = c.set("page_upgrade_at", "soon").unwrap_err();
        assert!(e.to_string().contains("page_upgrade_at"), "{e}");
        assert!(c.driver_share_upgrade, "on by default");
        c.set("driver_share_upgrade", "off").unwrap();
        assert!(!c.driver_share_upgrade);
        let e = c.set("driver_share_upgrade", "maybe").unwrap_err();
        assert!(e.to_string().contains("driver_share_upgrade"), "{e}");
        assert_eq!(c.driver_share_notice, Some(DEFAULT_DRIVER_SHARE_NOTICE));
        c.set("driver_share_notice", "off").unwrap();
        assert_eq!(c.driver_share_notice, None);
        c.set("driver_share_notice", "0.5").unwrap();
        assert_eq!(c.driver_share_notice, Some(0.5));
        c.set("driver_share_notice", "0").unwrap();
        assert_eq!(c.driver_share_notice, None);
        for bad in ["1.5", "-0.1", "lots"] {
            let e = c.set("driver_share_notice", bad).unwrap_err();
            assert!(
                e.to_string().contains("driver_share_notice") && e.to_string().contains(bad),
                "{e}"
            );
        }
        assert_eq!(c.page_upgrade_remap, 2.0);
        c.set("page_upgrade_remap", "0").unwrap();
        assert_eq!(c.page_upgrade_remap, 0.0);
        for bad in ["-1", "inf", "often"] {
            let e = c.set("page_upgrade_remap", bad).unwrap_err();
            assert!(e.to_string().contains("page_upgrade_remap"), "{e}");
        }
        for bad in ["0", "1.5", "-0.5", "nan", "high"] {
            let e = c.set("util_target", bad).unwrap_err();
            assert!(
                e.to_string().contains("util_target") && e.to_string().contains(bad),
                "{e}"
            );
        }
        c.set("util_target", "0.95").unwrap();
        assert_eq!(c.util_target, Some(0.95));
        c.set("util_target", "off").unwrap();
        assert_eq!(c.util_target, None);
        assert_eq!(c.alias_floor, 128 << 30);
        c.set("alias_floor", "1GiB").unwrap();
        assert_eq!(c.alias_floor, 1 << 30);
        let e = c.set("alias_floor", "lots").unwrap_err();
        assert!(e.to_string().contains("alias_floor"), "{e}");
        assert_eq!(
            c.replace_min_pages, 8,
            "windows under 8 pages replace nothing"
        );
        c.set("replace_min_pages", "0").unwrap();
        assert_eq!(c.replace_min_pages, 0);
        let e = c.set("replace_min_pages", "-1").unwrap_err();
        assert!(e.to_string().contains("replace_min_pages"), "{e}");
        assert!(c.stitch_tails_last, "on by default");
        c.set("stitch_tails_last", "0").unwrap();
        assert!(!c.stitch_tails_last);
        let e = c.set("stitch_tails_last", "sometimes").unwrap_err();
        assert!(e.to_string().contains("stitch_tails_last"), "{e}");
        assert!(c.cross_stream_wait, "on by default");
        c.set("cross_stream_wait", "0").unwrap();
        assert!(!c.cross_stream_wait);
        c.set("cross_stream_wait", "1").unwrap();
        assert!(c.cross_stream_wait);
        let e = c.set("cross_stream_wait", "sometimes").unwrap_err();
        assert!(e.to_string().contains("cross_stream_wait"), "{e}");
        assert!(!c.wait_to_reuse, "off by default");
        c.set("wait_to_reuse", "1").unwrap();
        assert!(c.wait_to_reuse);
        let e = c.set("wait_to_reuse", "maybe").unwrap_err();
        assert!(e.to_string().contains("wait_to_reuse"), "{e}");
        assert!(!c.reuse_fenced_blocks, "off by default");
        c.set("reuse_fenced_blocks", "1").unwrap();
        assert!(c.reuse_fenced_blocks);
        let e = c.set("reuse_fenced_blocks", "often").unwrap_err();
        assert!(e.to_string().contains("reuse_fenced_blocks"), "{e}");
        assert!(!c.host_timing, "off by default");
        c.set("host_timing", "1").unwrap();
        assert!(c.host_timing);
        let e = c.set("host_timing", "sometimes").unwrap_err();
        assert!(e.to_string().contains("host_timing"), "{e}");
    }

    #[test]
    fn roundup_power2_divisions_parse_as_pytorch() {
        let mut c = Config::default();
        assert_eq!(c.round_size(1), 512);
        assert_eq!(c.round_size(84 << 20), 84 << 20, "no rounding by default");
        c.apply_conf("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.roundup_power2_divisions, [4; ROUNDUP_INTERVALS]);
        // 84 MiB lies in [64, 128) MiB: steps of 16 MiB.
        assert_eq!(c.round_size(84 << 20), 96 << 20);
        assert_eq!(c.round_size(64 << 20), 64 << 20, "powers of two stay");
        assert_eq!(c.round_size(1000), 1024, "small sizes: 512-byte rounding");
        // PyTorch's test: 1200 with 4 divisions is 1280 (when 1200 > 512 x divisions).
        assert_eq!(round_size_with(1200, 2), 1536);
        assert_eq!(round_size_with(1200 << 10, 4), 1280 << 10);

        // The list syntax, inside a GMLAKE_CONF list (commas within brackets).
        c.apply_conf("fragLimit:2MiB,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1],max_aliases:2")
            .unwrap();
        assert_eq!(c.frag_limit, 2 << 20);
        assert_eq!(c.max_aliases, 2.0);
        // PyTorch's test_allocator_settings: 84 MiB gets 8 divisions, 400 MiB gets 2.
        assert_eq!(&c.roundup_power2_divisions[..7], &[8; 7]);
        assert_eq!(c.roundup_power2_divisions[7], 2);
        assert_eq!(c.roundup_divisions(84 << 20), 8);
        assert_eq!(c.roundup_divisions(400 << 20), 2);
        assert_eq!(c.roundup_divisions(1500 << 20), 1);
        let text = c
            .to_pairs()
            .into_iter()
            .find(|(k, _)| *k == "roundup_power2_divisions")
            .unwrap()
            .1;
        assert!(text.starts_with("[1:8,2:8,"), "{text}");
        let mut d = Config::default();
        d.set("roundup_power2_divisions", &text).unwrap();
        assert_eq!(d.roundup_power2_divisions, c.roundup_power2_divisions);

        for bad in ["3", "[64:3]", "[48:8]", "[64:8", "x", "[64]"] {
            let e = Config::default()
                .set("roundup_power2_divisions", bad)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("roundup_power2_divisions") && e.contains(bad),
                "{e}"
            );
        }
    }

    #[test]
    fn memory_fraction_accepts_zero_to_one() {
        let mut c = Config::default();
        c.set("memory_fraction", "0").unwrap();
        assert_eq!(c.memory_fraction, Some(0.0));
        c.set("memory_fraction", "1.0").unwrap();
        for bad in ["-0.1", "1.1", "half"] {
            let e = c.set("memory_fraction", bad).unwrap_err().to_string();
            assert!(e.contains("memory_fraction") && e.contains(bad), "{e}");
        }
    }
}
