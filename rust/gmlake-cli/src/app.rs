//! `gmlake replay`: reads each file, replays each of its devices, prints the results.

use crate::cli::ReplayArgs;
use crate::plot::{self, Panel, SERIES_POINTS};
use crate::progress::Progress;
use crate::replay::{replay, Backend, Measures, OursSummary, ReplayOptions, SimBackend, TraceOnly};
use crate::report::{self, Jitter, JitterRun, PageSizeTrial, Row};
use crate::series::Series;
use crate::trace::{read_trace, DeviceTrace};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// Exit status: everything replayed.
pub const EXIT_OK: i32 = 0;
/// Exit status: some file could not be read or replayed (the others were).
pub const EXIT_FAILED: i32 = 1;
/// Exit status: the options are unusable (nothing was replayed).
pub const EXIT_USAGE: i32 = 2;

/// What the chart needs from one replay.
struct Charted {
    title: String,
    series: Series,
    native_offset: u64,
    ours: bool,
}

/// The replay's allocator: side streams busy or not (`--busy-side-streams`).
fn make_backend(
    args: &ReplayArgs,
    capacity: u64,
    config: gmlake_core::Config,
) -> Result<SimBackend, gmlake_core::Error> {
    if args.busy_side_streams {
        SimBackend::busy_side_streams(capacity, config)
    } else {
        SimBackend::new(capacity, config)
    }
}

/// Runs `gmlake replay`; returns the process exit status.
pub fn run_replay(args: &ReplayArgs) -> i32 {
    let config = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gmlake: {e}");
            return EXIT_USAGE;
        }
    };
    let capacity = args.capacity_bytes();
    // Check once, before reading anything, that the allocator accepts the configuration.
    if !args.trace_only {
        if let Err(e) = make_backend(args, capacity, config.clone()) {
            eprintln!("gmlake: cannot create the allocator: {e}");
            return EXIT_USAGE;
        }
    }
    let options = ReplayOptions {
        strict: args.strict,
        deferred_frees: !args.instant_frees,
        windows: args.windows.map_or(0, usize::from),
        waste_at_peak: args.waste_at_peak,
        misses: args.misses,
        call_times: args.call_times,
        series_points: if args.plot.is_some() {
            SERIES_POINTS
        } else {
            0
        },
    };

    let mut progress = Progress::new();
    let mut stdout = std::io::stdout().lock();
    let mut rows = Vec::new();
    let mut charts = Vec::new();
    let mut failed = false;
    for path in &args.files {
        let name = path.display().to_string();
        progress.reading(&name);
        let read_start = Instant::now();
        let trace = match read_trace(path) {
            Ok(t) => t,
            Err(e) => {
                progress.clear();
                eprintln!("gmlake: {e}");
                failed = true;
                continue;
            }
        };
        let read_seconds = read_start.elapsed().as_secs_f64();
        if trace.devices.iter().all(|d| d.events.is_empty()) {
            progress.clear();
            eprintln!(
                "gmlake: {name}: no events in device_traces (record them with \
                 torch.cuda.memory._record_memory_history() before the snapshot)"
            );
            failed = true;
            continue;
        }
        for dev in trace.devices.iter().filter(|d| !d.events.is_empty()) {
            progress.replaying(&format!("{name} device {}", dev.device), dev.events.len());
            let result = if args.trace_only {
                replay_one(dev, &mut TraceOnly::default(), &options, &progress).map(|m| (m, None))
            } else {
                let backend = make_backend(args, capacity, config.clone());
                match backend {
                    Ok(mut backend) => {
                        replay_one(dev, &mut backend, &options, &progress).map(|m| {
                            let ours = backend.summary(m.sampled_peak_reserved_bytes);
                            (m, Some(ours))
                        })
                    }
                    Err(e) => Err(format!("cannot create the allocator: {e}")),
                }
            };
            progress.clear();
            let (measures, ours): (Measures, Option<OursSummary>) = match result {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("gmlake: {name}: {e}");
                    failed = true;
                    continue;
                }
            };
            let mut row = Row::new(name.clone(), dev.device, capacity, &measures, ours.as_ref());
            row.read_seconds = read_seconds;
            if let (Some(tolerance), Some(_)) = (args.suggest_page_size, &ours) {
                match page_size_trials(dev, args, &config, capacity, &options, &mut progress) {
                    Ok((page, trials)) => row.suggest_page_size(page, trials, tolerance),
                    Err(e) => {
                        progress.clear();
                        eprintln!("gmlake: {name}: --suggest-page-size: {e}");
                        failed = true;
                    }
                }
                progress.clear();
            }
            if let (Some(copies), Some(_)) = (args.jitter, &ours) {
                match jitter_runs(
                    dev,
                    args,
                    &config,
                    capacity,
                    &options,
                    &mut progress,
                    copies,
                ) {
                    Ok(mut runs) => {
                        runs.insert(0, JitterRun::of(0, &row));
                        row.jitter = Some(Jitter::of(runs));
                    }
                    Err(e) => {
                        progress.clear();
                        eprintln!("gmlake: {name}: --jitter: {e}");
                        failed = true;
                    }
                }
                progress.clear();
            }
            if args.json && writeln!(stdout, "{}", row.to_json_line()).is_err() {
                // Standard output is gone (e.g. a closed pipe): nothing more can be reported.
                return EXIT_FAILED;
            }
            if args.plot.is_some() {
                charts.push(Charted {
                    title: chart_title(&row),
                    native_offset: measures.native.offset(),
                    series: measures.series,
                    ours: ours.is_some(),
                });
            }
            rows.push(row);
        }
    }
    progress.clear();

    if !args.json && !rows.is_empty() {
        let mut text = report::table(&rows, args.capacity.is_some());
        for line in rows.iter().flat_map(Row::window_lines) {
            text.push_str(&line);
            text.push('\n');
        }
        for note in rows.iter().flat_map(Row::notes) {
            text.push_str("note: ");
            text.push_str(&note);
            text.push('\n');
        }
        if stdout.write_all(text.as_bytes()).is_err() {
            return EXIT_FAILED;
        }
    }
    let _ = stdout.flush();
    if let Some(plot_path) = &args.plot {
        if let Err(e) = write_chart(plot_path, &charts, args.capacity) {
            eprintln!(
                "gmlake: cannot write the chart {}: {e}",
                plot_path.display()
            );
            failed = true;
        }
    }
    if failed {
        EXIT_FAILED
    } else {
        EXIT_OK
    }
}

/// A further replay of `dev` for a comparison (`--jitter`, `--suggest-page-size`): the
/// allocator with `config`, the options without windows, series, waste or misses; its row.
fn replay_again(
    dev: &DeviceTrace,
    args: &ReplayArgs,
    config: gmlake_core::Config,
    capacity: u64,
    options: &ReplayOptions,
    progress: &mut Progress,
    what: &str,
) -> Result<Row, String> {
    let options = ReplayOptions {
        windows: 0,
        waste_at_peak: false,
        misses: false,
        call_times: false,
        series_points: 0,
        ..*options
    };
    let mut backend = make_backend(args, capacity, config)
        .map_err(|e| format!("cannot create the allocator: {e}"))?;
    progress.replaying(what, dev.events.len());
    let m = replay_one(dev, &mut backend, &options, progress)?;
    let ours = backend.summary(m.sampled_peak_reserved_bytes);
    Ok(Row::new(
        String::new(),
        dev.device,
        capacity,
        &m,
        Some(&ours),
    ))
}

/// `--jitter N`: the device's N jittered copies (seeds 1 to N), each replayed with the same
/// allocator.
fn jitter_runs(
    dev: &DeviceTrace,
    args: &ReplayArgs,
    config: &gmlake_core::Config,
    capacity: u64,
    options: &ReplayOptions,
    progress: &mut Progress,
    copies: u16,
) -> Result<Vec<JitterRun>, String> {
    (1..=u64::from(copies))
        .map(|seed| {
            let copy = dev.jittered(seed);
            let what = format!("jittered copy {seed}");
            let row = replay_again(
                &copy,
                args,
                config.clone(),
                capacity,
                options,
                progress,
                &what,
            )?;
            Ok(JitterRun::of(seed, &row))
        })
        .collect()
}

/// `--suggest-page-size`: the replay's page size, and the device replayed again with pages 2,
/// 4, 8, 16 and 32 times as large.
fn page_size_trials(
    dev: &DeviceTrace,
    args: &ReplayArgs,
    config: &gmlake_core::Config,
    capacity: u64,
    options: &ReplayOptions,
    progress: &mut Progress,
) -> Result<(u64, Vec<PageSizeTrial>), String> {
    let page = make_backend(args, capacity, config.clone())
        .map_err(|e| format!("cannot create the allocator: {e}"))?
        .page_size();
    let mut trials = Vec::new();
    for k in [2u64, 4, 8, 16, 32] {
        let cfg = gmlake_core::Config {
            page_size: page * k,
            ..config.clone()
        };
        let what = format!("page_size {}", report::bytes(page * k));
        let row = replay_again(dev, args, cfg, capacity, options, progress, &what)?;
        trials.push(PageSizeTrial {
            page_size: page * k,
            utilization: row.utilization,
            driver_ms_busy_second_half: row.driver_ms_busy_second_half,
        });
    }
    Ok((page, trials))
}

/// Replays one device, updating the progress bar; errors come back as text naming the
/// device and the event.
fn replay_one<B: Backend>(
    dev: &DeviceTrace,
    backend: &mut B,
    options: &ReplayOptions,
    progress: &Progress,
) -> Result<Measures, String> {
    replay(dev, backend, options, &mut |done| progress.set(done))
        .map_err(|e| format!("device_traces[{}] event {}: {e}", dev.device, e.event))
}

fn chart_title(row: &Row) -> String {
    let util = |u: Option<f64>| u.map_or("-".to_string(), |u| format!("{u:.3}"));
    let ours = match (row.fits, row.ooms) {
        (Some(false), Some(n)) => format!(
            "does not fit in {} ({n} allocations failed)",
            report::bytes(row.capacity_bytes)
        ),
        _ => format!("utilization {}", util(row.utilization)),
    };
    format!(
        "{} device {}: peak active {}, {ours}, native utilization {}",
        row.trace,
        row.device,
        report::bytes(row.peak_active_bytes),
        util(row.native_utilization),
    )
}

fn write_chart(path: &Path, charts: &[Charted], capacity: Option<u64>) -> Result<(), String> {
    if charts.is_empty() {
        return Err("nothing was replayed".into());
    }
    let panels: Vec<Panel> = charts
        .iter()
        .map(|c| Panel {
            title: c.title.clone(),
            points: c.series.points(),
            native_offset: c.native_offset,
            ours: c.ours,
            capacity,
        })
        .collect();
    plot::write_svg(path, &panels)
}
