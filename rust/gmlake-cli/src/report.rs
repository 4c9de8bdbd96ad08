//! The results of replays: one [`Row`] per (trace, device), printed as a table for people or
//! as one JSON object per line for programs.

use crate::replay::{Measures, OursSummary, WindowSnapshot, WINDOW_COUNTERS};
use gmlake_core::DriverCalls;
use serde::Serialize;
use serde_json::{Map, Value};

/// One replayed (trace, device).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub trace: String,
    pub device: usize,
    pub events: usize,
    /// `free_completed`, or `free_requested` for a trace without completions.
    pub free_action: &'static str,
    pub peak_active_bytes: u64,
    /// Our peak physical memory (null with `--trace-only`).
    pub peak_reserved_bytes: Option<u64>,
    /// peak active / our peak reserved.
    pub utilization: Option<f64>,
    pub native_peak_reserved_bytes: u64,
    pub native_utilization: Option<f64>,
    /// Native peak reserved minus ours (negative: we held more).
    pub saved_bytes: Option<i64>,
    /// `saved_bytes` / native peak reserved.
    pub saved_fraction: Option<f64>,
    pub stitches: Option<u64>,
    pub pages_stitched: Option<u64>,
    /// Driver calls by kind, plus `total`.
    pub driver_calls: Option<Map<String, Value>>,
    /// Driver calls per 1,000 replayed events: over the whole trace, and over its second half
    /// (after the first half of the events: the steady state of a periodic job).
    pub driver_calls_per_1k_events: Option<f64>,
    pub driver_calls_per_1k_events_second_half: Option<f64>,
    /// Driver calls made in the second half of the trace.
    pub driver_calls_second_half: Option<u64>,
    /// `--windows N`: each window's events (`first_event`, `events`), driver calls by kind
    /// with their `total`, and the stitcher's counters (`replay::WINDOW_COUNTERS`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_calls_windows: Option<Vec<Map<String, Value>>>,
    /// `--waste-at-peak`: where the held memory sat at its peak (`waste::Waste`, bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waste_at_peak: Option<crate::waste::Waste>,
    /// `--misses`: the second half's allocations that took no kept window, summed, with the
    /// first of them (`misses::Misses`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub misses_second_half: Option<crate::misses::Misses>,
    /// `--call-times`: the distribution of the allocator's allocations and frees, ns
    /// (`call_times::CallTimesRow`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_times: Option<crate::call_times::CallTimesRow>,
    /// Estimated host time of the driver calls (ms), from per-call costs measured on an H100
    /// (`cost.rs`): idle GPU and busy GPU, whole trace and second half.
    pub driver_ms_idle: Option<f64>,
    pub driver_ms_busy: Option<f64>,
    pub driver_ms_idle_second_half: Option<f64>,
    pub driver_ms_busy_second_half: Option<f64>,
    /// The simulated device's size.
    pub capacity_bytes: u64,
    /// Every allocation was served within the capacity.
    pub fits: Option<bool>,
    /// Allocations our allocator refused for lack of memory (replayed without them).
    pub ooms: Option<u64>,
    /// The first refused allocation: its event index and the allocator's message.
    pub first_oom_event: Option<usize>,
    pub first_oom_message: Option<String>,
    /// The native allocator's peak reserved memory stayed within the capacity.
    pub native_fits: bool,
    /// `oom` events recorded in the trace by the native allocator.
    pub native_oom_events: u64,
    /// Frees of addresses with no live allocation (ignored; `--strict` makes them fatal).
    pub unknown_frees: u64,
    /// Frees replayed as waiting for other streams: freed at `free_requested`, reusable from
    /// the trace's `free_completed` (0 with `--instant-frees`).
    pub deferred_frees: u64,
    /// Allocations at a still-live address (the older one was freed first).
    pub duplicate_allocs: u64,
    /// Events with an action this version does not know (ignored).
    pub unknown_actions: u64,
    /// Wall time to read and decode the file (shared by its devices).
    pub read_seconds: f64,
    /// Wall time of the replay loop.
    pub replay_seconds: f64,
    /// CPU time of the replay loop, allocator included.
    pub cpu_seconds: Option<f64>,
    pub cpu_us_per_event: Option<f64>,
    /// The allocator's configuration.
    pub config: Option<Map<String, Value>>,
    /// `--suggest-page-size`: the page size suggested (null: keep the replay's own), the
    /// tolerance, and each larger page size tried with its utilization and estimated driver
    /// time (busy GPU, second half).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_size_suggestion: Option<PageSizeSuggestion>,
    /// `--jitter N`: the figures of the trace and of its N jittered copies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jitter: Option<Jitter>,
    /// With `page_upgrade_at`: whether the page-size upgrade happened (`upgraded`), the page
    /// new memory got at the end (`page_size`), the smaller pages given back
    /// (`pages_drained`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_upgrade: Option<crate::replay::PageUpgrade>,
}

/// The median and the range of one figure over a trace and its jittered copies.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// None when `values` is empty. The median of an even count is the mean of the middle two.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

/// `--jitter N`: utilization and the second half's driver figures over the trace and its
/// `copies` jittered copies (`DeviceTrace::jittered`, seeds 1 to N).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Jitter {
    pub copies: u16,
    /// Each figure of each replay, the trace's first.
    pub runs: Vec<JitterRun>,
    pub utilization: Option<Spread>,
    pub driver_calls_second_half: Option<Spread>,
    pub driver_ms_busy_second_half: Option<Spread>,
}

/// One replay of `--jitter`: the trace (seed 0) or a copy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct JitterRun {
    pub seed: u64,
    pub utilization: Option<f64>,
    pub driver_calls_second_half: Option<u64>,
    pub driver_ms_busy_second_half: Option<f64>,
}

impl JitterRun {
    pub fn of(seed: u64, row: &Row) -> JitterRun {
        JitterRun {
            seed,
            utilization: row.utilization,
            driver_calls_second_half: row.driver_calls_second_half,
            driver_ms_busy_second_half: row.driver_ms_busy_second_half,
        }
    }
}

impl Jitter {
    /// The spreads of `runs` (the trace's own first).
    pub fn of(runs: Vec<JitterRun>) -> Jitter {
        let pick = |f: &dyn Fn(&JitterRun) -> Option<f64>| -> Option<Spread> {
            Spread::of(&runs.iter().filter_map(f).collect::<Vec<_>>())
        };
        Jitter {
            copies: runs.len().saturating_sub(1) as u16,
            utilization: pick(&|r| r.utilization),
            driver_calls_second_half: pick(&|r| r.driver_calls_second_half.map(|c| c as f64)),
            driver_ms_busy_second_half: pick(&|r| r.driver_ms_busy_second_half),
            runs,
        }
    }

    /// The table's note.
    pub fn line(&self) -> String {
        let spread = |s: &Option<Spread>, prec: usize| match s {
            Some(s) => format!("{:.p$} ({:.p$}-{:.p$})", s.median, s.min, s.max, p = prec),
            None => "-".into(),
        };
        format!(
            "over the trace and {} jittered copies (each allocation 0-3.5 KiB larger): \
             utilization median {}, second-half driver calls {}, estimated busy driver ms {}",
            self.copies,
            spread(&self.utilization, 3),
            spread(&self.driver_calls_second_half, 0),
            spread(&self.driver_ms_busy_second_half, 0),
        )
    }
}

/// One page size tried by `--suggest-page-size`.
#[derive(Clone, Debug, Serialize)]
pub struct PageSizeTrial {
    pub page_size: u64,
    pub utilization: Option<f64>,
    pub driver_ms_busy_second_half: Option<f64>,
}

/// What `--suggest-page-size` found for one device.
#[derive(Clone, Debug, Serialize)]
pub struct PageSizeSuggestion {
    /// The largest page size tried that kept utilization within `tolerance` of the replay's
    /// with less driver time; None: keep `replayed_page_size`.
    pub page_size: Option<u64>,
    pub tolerance: f64,
    pub replayed_page_size: u64,
    pub tried: Vec<PageSizeTrial>,
}

impl Row {
    /// Chooses, among `trials` (larger page sizes than this row's), the largest whose
    /// utilization is within `tolerance` of this row's and whose estimated driver time is
    /// lower, and records the choice and the trials.
    pub fn suggest_page_size(
        &mut self,
        page_size: u64,
        trials: Vec<PageSizeTrial>,
        tolerance: f64,
    ) {
        let (Some(base), Some(base_ms)) = (self.utilization, self.driver_ms_busy_second_half)
        else {
            return;
        };
        let chosen = trials
            .iter()
            .filter(|t| {
                t.utilization.is_some_and(|u| u >= base - tolerance)
                    && t.driver_ms_busy_second_half.is_some_and(|ms| ms < base_ms)
            })
            .map(|t| t.page_size)
            .max();
        self.page_size_suggestion = Some(PageSizeSuggestion {
            page_size: chosen,
            tolerance,
            replayed_page_size: page_size,
            tried: trials,
        });
    }
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

/// `calls` by kind, and their `total`, added to `map`.
fn calls_map(calls: &DriverCalls, mut map: Map<String, Value>) -> Map<String, Value> {
    for (k, v) in calls.as_pairs() {
        map.insert(k.to_string(), v.into());
    }
    map.insert("total".into(), calls.total().into());
    map
}

/// Per-window driver calls and stitching counters (deltas between the cumulative snapshots
/// of a replay).
fn window_rows(snapshots: &[WindowSnapshot]) -> Option<Vec<Map<String, Value>>> {
    if snapshots.is_empty() {
        return None;
    }
    let mut rows = Vec::with_capacity(snapshots.len());
    let mut before: WindowSnapshot = Default::default();
    for now @ (end, calls, counts) in snapshots {
        let mut head = Map::new();
        head.insert("first_event".into(), before.0.into());
        head.insert("events".into(), (end - before.0).into());
        for ((k, v), was) in WINDOW_COUNTERS.iter().zip(counts).zip(before.2) {
            head.insert(k.to_string(), v.saturating_sub(was).into());
        }
        rows.push(calls_map(&crate::cost::difference(calls, &before.1), head));
        before = *now;
    }
    Some(rows)
}

impl Row {
    /// `--windows`: one line per window (table output).
    pub fn window_lines(&self) -> Vec<String> {
        let Some(w) = &self.driver_calls_windows else {
            return Vec::new();
        };
        let n = |r: &Map<String, Value>, k: &str| r.get(k).and_then(Value::as_u64).unwrap_or(0);
        w.iter()
            .enumerate()
            .map(|(i, r)| {
                format!(
                    "{} dev {} window {}/{} (events {}-{}): {} driver calls: map {}, unmap {}, \
                     set_access {}, create {}, release {}, events {}; stitches {} ({} pages), \
                     reuses {} ({} pages), aliases replaced {}, evicted {}",
                    self.trace,
                    self.device,
                    i + 1,
                    w.len(),
                    n(r, "first_event"),
                    n(r, "first_event") + n(r, "events"),
                    n(r, "total"),
                    n(r, "map"),
                    n(r, "unmap"),
                    n(r, "set_access"),
                    n(r, "create_physical"),
                    n(r, "release_physical"),
                    n(r, "create_event") + n(r, "record_event") + n(r, "query_event"),
                    n(r, "stitches"),
                    n(r, "pages_stitched"),
                    n(r, "stitch_reuses"),
                    n(r, "pages_reused"),
                    n(r, "aliases_replaced"),
                    n(r, "alias_evictions"),
                )
            })
            .collect()
    }

    pub fn new(
        trace: String,
        device: usize,
        capacity: u64,
        m: &Measures,
        ours: Option<&OursSummary>,
    ) -> Row {
        let native = m.native.peak();
        let reserved = ours.map(|o| o.peak_reserved_bytes);
        let saved = reserved.map(|r| native as i64 - r as i64);
        let per_event = |s: f64| (m.events > 0).then(|| s * 1e6 / m.events as f64);
        let second = ours.map(|o| match &m.half_driver_calls {
            Some(h) => crate::cost::difference(&o.driver_calls, h),
            None => o.driver_calls,
        });
        let second_events = m.events - m.events / 2;
        let per_1k =
            |calls: u64, events: usize| (events > 0).then(|| calls as f64 * 1000.0 / events as f64);
        let est = ours.map(|o| crate::cost::estimate_ms(&o.driver_calls));
        let est2 = second.as_ref().map(crate::cost::estimate_ms);
        Row {
            trace,
            device,
            events: m.events,
            free_action: m.free_action.name(),
            peak_active_bytes: m.peak_active_bytes,
            peak_reserved_bytes: reserved,
            utilization: reserved.and_then(|r| ratio(m.peak_active_bytes, r)),
            native_peak_reserved_bytes: native,
            native_utilization: ratio(m.peak_active_bytes, native),
            saved_bytes: saved,
            saved_fraction: saved.and_then(|s| (native > 0).then(|| s as f64 / native as f64)),
            stitches: ours.map(|o| o.stitches),
            pages_stitched: ours.map(|o| o.pages_stitched),
            driver_calls: ours.map(|o| calls_map(&o.driver_calls, Map::new())),
            driver_calls_per_1k_events: ours.and_then(|o| per_1k(o.driver_calls.total(), m.events)),
            driver_calls_per_1k_events_second_half: second
                .as_ref()
                .and_then(|c| per_1k(c.total(), second_events)),
            driver_calls_second_half: second.as_ref().map(|c| c.total()),
            driver_calls_windows: window_rows(&m.windows),
            waste_at_peak: m.waste_at_peak,
            misses_second_half: ours
                .and(m.misses.as_ref())
                .map(|v| crate::misses::Misses::of(v)),
            call_times: m
                .call_times
                .as_ref()
                .map(crate::call_times::CallTimesRow::of),
            driver_ms_idle: est.map(|e| e.0),
            driver_ms_busy: est.map(|e| e.1),
            driver_ms_idle_second_half: est2.map(|e| e.0),
            driver_ms_busy_second_half: est2.map(|e| e.1),
            capacity_bytes: capacity,
            fits: ours.map(|_| m.ooms == 0),
            ooms: ours.map(|_| m.ooms),
            first_oom_event: m.first_oom.as_ref().map(|(i, _)| *i),
            first_oom_message: m.first_oom.as_ref().map(|(_, s)| s.clone()),
            native_fits: native <= capacity,
            native_oom_events: m.native.oom_events(),
            unknown_frees: m.unknown_frees,
            deferred_frees: m.deferred_frees,
            duplicate_allocs: m.duplicate_allocs,
            unknown_actions: m.unknown_actions,
            read_seconds: 0.0,
            replay_seconds: m.wall_seconds,
            cpu_seconds: m.cpu_seconds,
            cpu_us_per_event: per_event(m.cpu_seconds.unwrap_or(m.wall_seconds)),
            config: ours.map(|o| {
                o.config
                    .iter()
                    .map(|(k, v)| (k.to_string(), Value::String(v.clone())))
                    .collect()
            }),
            page_size_suggestion: None,
            jitter: None,
            page_upgrade: ours.and_then(|o| o.page_upgrade),
        }
    }

    /// The row as one line of JSON.
    pub fn to_json_line(&self) -> String {
        // A struct of plain fields and string-keyed maps always serializes; keep a fallback
        // anyway rather than a panic.
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":{:?}}}", e.to_string()))
    }

    /// Things a reader of the table should know about this row, one sentence each.
    pub fn notes(&self) -> Vec<String> {
        let at = format!("{} device {}", self.trace, self.device);
        let mut notes = Vec::new();
        if let Some(w) = &self.waste_at_peak {
            notes.push(format!("{at}: at the peak, {}", w.line()));
        }
        if let Some(m) = &self.misses_second_half {
            notes.push(format!("{at}: {}", m.line()));
        }
        if let Some(c) = &self.call_times {
            notes.push(format!("{at}: {}", c.line()));
        }
        if let Some(j) = &self.jitter {
            notes.push(format!("{at}: {}", j.line()));
        }
        if let Some(s) = &self.page_size_suggestion {
            let (tol, base) = (s.tolerance, self.utilization.unwrap_or(0.0));
            let base_ms = self.driver_ms_busy_second_half.unwrap_or(0.0);
            let list: Vec<String> = s
                .tried
                .iter()
                .map(|t| {
                    format!(
                        "{}: {:.3}, {:.0} ms",
                        bytes(t.page_size),
                        t.utilization.unwrap_or(0.0),
                        t.driver_ms_busy_second_half.unwrap_or(0.0)
                    )
                })
                .collect();
            notes.push(match s.page_size {
                Some(p) => format!(
                    "{at}: page_size={} keeps utilization within {tol} of {base:.3} and cuts the \
                     estimated driver time (busy GPU, second half) from {base_ms:.0} ms: \
                     GMLAKE_CONF=page_size:{} (tried: {})",
                    bytes(p),
                    if p % (1 << 20) == 0 {
                        format!("{}MiB", p >> 20)
                    } else {
                        p.to_string()
                    },
                    list.join("; ")
                ),
                None => format!(
                    "{at}: keep page_size={}: no larger page keeps utilization within {tol} of \
                     {base:.3} with less driver time (tried: {})",
                    bytes(s.replayed_page_size),
                    list.join("; ")
                ),
            });
        }
        // Only where it happened: it is on by default, and most jobs never switch (the JSON
        // says `upgraded: false` for them).
        if let Some(u) = self.page_upgrade.as_ref().filter(|u| u.upgraded) {
            notes.push(format!(
                "{at}: the page-size upgrade happened: new memory got {} pages, and {} \
                 smaller pages went back to the device",
                bytes(u.page_size),
                u.pages_drained
            ));
        }
        if self.unknown_frees > 0 {
            notes.push(format!(
                "{at}: {} {} event(s) of addresses never allocated in the trace were ignored \
                 (the trace may start mid-run; --strict makes this an error)",
                self.unknown_frees, self.free_action
            ));
        }
        if self.duplicate_allocs > 0 {
            notes.push(format!(
                "{at}: {} allocation(s) at a still-live address: the earlier one was freed first",
                self.duplicate_allocs
            ));
        }
        if self.unknown_actions > 0 {
            notes.push(format!(
                "{at}: {} event(s) with an unknown action were ignored",
                self.unknown_actions
            ));
        }
        if let (Some(n @ 1..), Some(i), Some(msg)) =
            (self.ooms, self.first_oom_event, &self.first_oom_message)
        {
            notes.push(format!(
                "{at}: does not fit in {}: {n} allocation(s) failed and were skipped (so its \
                 utilization compares the trace's active memory with a replay without them); \
                 the first at event {i}: {msg}",
                bytes(self.capacity_bytes)
            ));
        }
        if self.native_oom_events > 0 {
            notes.push(format!(
                "{at}: the trace records {} native out-of-memory event(s)",
                self.native_oom_events
            ));
        }
        notes
    }
}

/// Bytes for people: GiB from 1 GiB up, MiB from 1 MiB, KiB below.
pub fn bytes(b: u64) -> String {
    const KIB: f64 = 1024.0;
    let x = b as f64;
    if x >= KIB * KIB * KIB {
        format!("{:.2} GiB", x / (KIB * KIB * KIB))
    } else if x >= KIB * KIB {
        format!("{:.1} MiB", x / (KIB * KIB))
    } else if b >= 1024 {
        format!("{:.1} KiB", x / KIB)
    } else {
        format!("{b} B")
    }
}

fn signed_bytes(b: i64) -> String {
    if b < 0 {
        format!("-{}", bytes(b.unsigned_abs()))
    } else {
        bytes(b as u64)
    }
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.to_string()
}

/// The rows as an aligned text table. `capacity` adds the columns on fitting in the device.
pub fn table(rows: &[Row], capacity: bool) -> String {
    let mut header = vec![
        "trace",
        "dev",
        "events",
        "peak active",
        "ours reserved",
        "util",
        "native reserved",
        "native util",
        "saved",
        "saved %",
        "stitches",
        "driver calls",
        "calls/1k ev (2nd half)",
        "est. driver ms idle/busy (2nd half)",
        "cpu µs/event",
    ];
    if capacity {
        header.extend(["fits", "native fits"]);
    }
    let mut cells: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for r in rows {
        let mut line = vec![
            r.trace.clone(),
            r.device.to_string(),
            r.events.to_string(),
            bytes(r.peak_active_bytes),
            opt(r.peak_reserved_bytes, bytes),
            opt(r.utilization, |u| format!("{u:.3}")),
            bytes(r.native_peak_reserved_bytes),
            opt(r.native_utilization, |u| format!("{u:.3}")),
            opt(r.saved_bytes, signed_bytes),
            opt(r.saved_fraction, |f| format!("{:.1}%", f * 100.0)),
            opt(r.stitches, |s| s.to_string()),
            opt(r.driver_calls.as_ref(), |c| {
                c.get("total").map_or("-".into(), |t| t.to_string())
            }),
            opt(r.driver_calls_per_1k_events_second_half, |c| {
                format!("{c:.1}")
            }),
            match (r.driver_ms_idle_second_half, r.driver_ms_busy_second_half) {
                (Some(i), Some(b)) => format!("{i:.1}/{b:.1}"),
                _ => "-".into(),
            },
            opt(r.cpu_us_per_event, |u| format!("{u:.3}")),
        ];
        if capacity {
            line.push(opt(r.fits, |f| {
                if f {
                    yes_no(true)
                } else {
                    format!("no ({} OOM)", r.ooms.unwrap_or(0))
                }
            }));
            line.push(yes_no(r.native_fits));
        }
        cells.push(line);
    }
    let columns = cells[0].len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            cells
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (n, line) in cells.iter().enumerate() {
        let mut text = String::new();
        for (c, cell) in line.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c > 0 {
                text.push_str("  ");
            }
            // The trace name is left-aligned, figures right-aligned.
            if c == 0 {
                text.push_str(cell);
                text.extend(std::iter::repeat_n(' ', pad));
            } else {
                text.extend(std::iter::repeat_n(' ', pad));
                text.push_str(cell);
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
        if n == 0 {
            let total: usize = widths.iter().sum::<usize>() + 2 * (columns - 1);
            out.push_str(&"-".repeat(total));
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    /// The median of an odd count is the middle value, of an even count the mean of the two
    /// middle ones; the range is the extremes; nothing gives nothing (and NaN is left out).
    #[test]
    fn a_spread_is_the_median_and_the_range() {
        let s = Spread::of(&[0.9, 0.7, 0.8]).unwrap();
        assert_eq!((s.median, s.min, s.max), (0.8, 0.7, 0.9));
        let s = Spread::of(&[4.0, 1.0, 3.0, 2.0, f64::NAN]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(Spread::of(&[f64::NAN]), None);
    }

    use super::*;
    use crate::native::NativeMeter;
    use crate::series::Series;
    use crate::trace::{Action, Event};
    use gmlake_core::DriverCalls;

    fn measures() -> Measures {
        let mut native = NativeMeter::default();
        native.observe(&Event {
            addr: 0,
            size: 4 << 30,
            stream: 0,
            action: Action::SegmentAlloc,
        });
        Measures {
            events: 1000,
            free_action: Action::FreeCompleted,
            peak_active_bytes: 3 << 30,
            sampled_peak_reserved_bytes: 3 << 30,
            native,
            ooms: 0,
            first_oom: None,
            unknown_frees: 2,
            deferred_frees: 0,
            duplicate_allocs: 0,
            unknown_actions: 0,
            wall_seconds: 0.002,
            cpu_seconds: Some(0.001),
            series: Series::default(),
            half_driver_calls: None,
            windows: Vec::new(),
            waste_at_peak: None,
            misses: None,
            call_times: None,
        }
    }

    fn ours() -> OursSummary {
        OursSummary {
            peak_reserved_bytes: 3 << 30,
            stitches: 5,
            pages_stitched: 9,
            driver_calls: DriverCalls {
                map: 7,
                unmap: 3,
                ..DriverCalls::default()
            },
            config: vec![("fragLimit", "0".into())],
            page_upgrade: None,
        }
    }

    #[test]
    fn the_page_upgrade_is_reported_when_set() {
        let mut o = ours();
        let r = Row::new("a.pickle".into(), 0, 1 << 40, &measures(), Some(&o));
        assert!(r.page_upgrade.is_none());
        let json: Value = serde_json::from_str(&r.to_json_line()).unwrap();
        assert!(json.get("page_upgrade").is_none());
        for upgraded in [false, true] {
            o.page_upgrade = Some(crate::replay::PageUpgrade {
                upgraded,
                page_size: 8 << 20,
                pages_drained: 12,
            });
            let r = Row::new("a.pickle".into(), 0, 1 << 40, &measures(), Some(&o));
            let json: Value = serde_json::from_str(&r.to_json_line()).unwrap();
            assert_eq!(json["page_upgrade"]["upgraded"], upgraded);
            assert_eq!(json["page_upgrade"]["pages_drained"], 12);
            let notes = r.notes().join("\n");
            assert_eq!(
                notes.contains("the page-size upgrade happened: new memory got 8.0 MiB pages"),
                upgraded,
                "{notes}"
            );
        }
    }

    #[test]
    fn row_figures() {
        let r = Row::new("a.pickle".into(), 0, 1 << 40, &measures(), Some(&ours()));
        assert_eq!(r.utilization, Some(1.0));
        assert_eq!(r.native_utilization, Some(0.75));
        assert_eq!(r.saved_bytes, Some(1 << 30));
        assert_eq!(r.saved_fraction, Some(0.25));
        assert_eq!(r.fits, Some(true));
        assert!(r.native_fits);
        assert_eq!(r.cpu_us_per_event, Some(1.0));
        let json: Value = serde_json::from_str(&r.to_json_line()).unwrap();
        for key in [
            "trace",
            "device",
            "events",
            "peak_active_bytes",
            "peak_reserved_bytes",
            "utilization",
            "native_peak_reserved_bytes",
            "native_utilization",
            "stitches",
            "replay_seconds",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert_eq!(json["driver_calls"]["total"], 10);
        assert_eq!(json["driver_calls"]["map"], 7);
        assert_eq!(r.notes().len(), 1, "{:?}", r.notes());
    }

    #[test]
    fn trace_only_rows_have_no_figures_of_ours() {
        let r = Row::new("a.pickle".into(), 0, 1 << 40, &measures(), None);
        assert_eq!(r.utilization, None);
        assert_eq!(r.fits, None);
        let t = table(&[r], true);
        assert!(t.contains(" - "), "{t}");
    }

    #[test]
    fn table_is_aligned() {
        let a = Row::new("a.pickle".into(), 0, 1 << 40, &measures(), Some(&ours()));
        let mut b = a.clone();
        b.trace = "longer-name.pickle".into();
        let t = table(&[a, b], false);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("trace "));
        assert!(lines[2].contains("3.00 GiB") && lines[2].contains("1.000"));
        assert!(lines[2].contains("25.0%"));
        let w = lines[0].chars().count();
        assert!(lines[2..].iter().all(|l| l.chars().count() == w), "{t}");
    }

    #[test]
    fn byte_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 19), "1.5 MiB");
        assert_eq!(bytes(5 << 29), "2.50 GiB");
        assert_eq!(signed_bytes(-(1 << 30)), "-1.00 GiB");
    }
}
