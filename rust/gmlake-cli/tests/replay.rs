//! Runs the real `gmlake` binary over the traces bundled in tests/traces.

use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TRACES: [&str; 5] = [
    "decode.pickle",
    "gpt-ckpt.pickle",
    "moe.pickle",
    "moe-3steps-real.pickle",
    "stress.pickle",
];

fn trace(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/traces")
        .join(name)
}

/// A fresh scratch directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("replay-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn gmlake<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gmlake"))
        .args(args)
        .output()
        .expect("the gmlake binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The JSON lines of a successful `gmlake replay --json`.
fn json_rows(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "gmlake failed: {}\n{}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The JSON row of the first device of `gmlake replay --json ARGS... tests/traces/NAME`.
fn replay_row(name: &str, args: &[&str]) -> Value {
    let t = trace(name);
    let mut all: Vec<&std::ffi::OsStr> = vec!["replay".as_ref(), "--json".as_ref()];
    all.extend(args.iter().map(|a| std::ffi::OsStr::new(*a)));
    all.push(t.as_os_str());
    json_rows(&gmlake(&all)).remove(0)
}

/// `replay_row` over the trace and `copies` jittered copies (`--jitter`): the row, whose
/// `jitter` holds the medians and ranges that claims about one trace's layout should read.
fn jittered_row(name: &str, args: &[&str], copies: u32) -> Value {
    let copies = copies.to_string();
    let mut all = args.to_vec();
    all.extend(["--jitter", &copies]);
    replay_row(name, &all)
}

/// An event as the test reads it, independently of the crate's own parser.
#[derive(deser::Deserialize, deser::Serialize)]
struct TestEvent {
    action: String,
    addr: Option<u64>,
    size: Option<u64>,
    stream: Option<u64>,
}

#[derive(deser::Deserialize, deser::Serialize)]
struct TestSnapshot {
    device_traces: Vec<Vec<TestEvent>>,
}

fn read_snapshot(path: &Path) -> TestSnapshot {
    let bytes = std::fs::read(path).unwrap();
    deser_pickle::DeserializerConfig::builder()
        .max_shared_events(usize::MAX)
        .build()
        .from_slice(&bytes)
        .unwrap()
}

/// Peak of the running sum of live allocation sizes, per device: an allocation is live from
/// its `alloc` to its `free_completed` (`free_requested` in traces without completions).
fn peak_active(snapshot: &TestSnapshot) -> Vec<u64> {
    snapshot
        .device_traces
        .iter()
        .map(|events| {
            let free = if events.iter().any(|e| e.action == "free_completed") {
                "free_completed"
            } else {
                "free_requested"
            };
            let mut live = HashMap::new();
            let (mut now, mut peak) = (0u64, 0u64);
            for e in events {
                let addr = e.addr.unwrap_or(0);
                if e.action == "alloc" {
                    let size = e.size.unwrap();
                    if let Some(old) = live.insert(addr, size) {
                        now -= old;
                    }
                    now += size;
                    peak = peak.max(now);
                } else if e.action == free {
                    now -= live.remove(&addr).unwrap_or(0);
                }
            }
            peak
        })
        .collect()
}

#[test]
fn bundled_traces_beat_native_utilization_and_match_active_bytes() {
    let paths: Vec<PathBuf> = TRACES.iter().map(|t| trace(t)).collect();
    let mut args = vec!["replay".into(), "--json".into()];
    args.extend(paths.iter().map(|p| p.as_os_str().to_owned()));
    let rows = json_rows(&gmlake(&args));
    assert_eq!(
        rows.len(),
        TRACES.len(),
        "one row per trace (each has one device)"
    );
    for (row, path) in rows.iter().zip(&paths) {
        let name = row["trace"].as_str().unwrap();
        assert_eq!(Path::new(name), path.as_path());
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
            assert!(row.get(key).is_some(), "{name}: no {key}");
        }
        let expected = peak_active(&read_snapshot(path));
        let device = row["device"].as_u64().unwrap() as usize;
        assert_eq!(
            row["peak_active_bytes"].as_u64().unwrap(),
            expected[device],
            "{name}: peak active bytes"
        );
        let util = row["utilization"].as_f64().unwrap();
        let native = row["native_utilization"].as_f64().unwrap();
        assert!(
            util > native,
            "{name}: utilization {util} is not above native {native}"
        );
        assert!(
            util <= 1.0,
            "{name}: utilization {util} above 1 without OOMs"
        );
        assert_eq!(row["fits"], true, "{name}");
        assert_eq!(row["unknown_frees"], 0, "{name}");
        assert!(row["driver_calls"]["total"].as_u64().unwrap() > 0, "{name}");
        assert!(row["events"].as_u64().unwrap() > 1000, "{name}");
    }
}

#[test]
fn default_output_is_a_table() {
    let out = gmlake(&["replay".as_ref(), trace("decode.pickle").as_os_str()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("trace") && lines[0].contains("native util"),
        "{stdout}"
    );
    assert!(
        lines[2].contains("decode.pickle") && lines[2].contains("MiB"),
        "{stdout}"
    );
}

#[test]
fn gzip_compressed_pickles_give_the_same_figures() {
    use std::io::Write;
    let dir = scratch("gzip");
    let plain = trace("decode.pickle");
    let gz = dir.join("decode.pickle.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(&std::fs::read(&plain).unwrap()).unwrap();
    std::fs::write(&gz, enc.finish().unwrap()).unwrap();
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        plain.as_os_str(),
        gz.as_os_str(),
    ]));
    for key in [
        "events",
        "peak_active_bytes",
        "peak_reserved_bytes",
        "stitches",
    ] {
        assert_eq!(rows[0][key], rows[1][key], "{key}");
    }
}

fn assert_fails_naming(out: &Output, path: &Path, what: &str) {
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{what}: exited 0");
    assert!(
        stderr.contains(&path.display().to_string()),
        "{what}: the error does not name the file: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
}

#[test]
fn bad_inputs_fail_with_the_file_named() {
    let dir = scratch("bad");
    let textfile = dir.join("notes.txt");
    std::fs::write(&textfile, "this is not a pickle\n").unwrap();
    let truncated = dir.join("truncated.pickle");
    let bytes = std::fs::read(trace("stress.pickle")).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let list = dir.join("list.pickle");
    // pickle.dumps([1, 2, 3], protocol=4)
    std::fs::write(
        &list,
        b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02K\x03e.",
    )
    .unwrap();
    let missing = dir.join("does-not-exist.pickle");
    let empty = dir.join("empty.pickle");
    std::fs::write(&empty, b"").unwrap();

    for (path, what, expect) in [
        (&textfile, "a text file", "not a pickle"),
        (&truncated, "a truncated pickle", "truncated"),
        (&list, "a pickle of a list", "not a memory snapshot"),
        (&missing, "a missing file", "does-not-exist.pickle"),
        (&empty, "an empty file", "empty file"),
    ] {
        let out = gmlake(&["replay".as_ref(), path.as_os_str()]);
        assert_fails_naming(&out, path, what);
        let stderr = text(&out.stderr);
        assert!(stderr.contains(expect), "{what}: {stderr}");
    }

    // A bad file among good ones: the good ones are still reported, the exit status fails.
    let out = gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        textfile.as_os_str(),
        trace("decode.pickle").as_os_str(),
    ]);
    assert_fails_naming(&out, &textfile, "a text file before a good trace");
    assert_eq!(text(&out.stdout).lines().count(), 1);
}

fn event(action: &str, addr: u64, size: u64) -> TestEvent {
    TestEvent {
        action: action.into(),
        addr: Some(addr),
        size: Some(size),
        stream: Some(0),
    }
}

/// A small snapshot whose event 3 frees an address that was never allocated.
fn write_bogus_free_trace(dir: &Path) -> PathBuf {
    let snapshot = TestSnapshot {
        device_traces: vec![vec![
            event("segment_alloc", 1 << 30, 4 << 20),
            event("alloc", 1 << 30, 1 << 20),
            event("alloc", (1 << 30) + (1 << 20), 1 << 20),
            event("free_completed", 0xdead000, 512),
            event("free_completed", 1 << 30, 1 << 20),
        ]],
    };
    let path = dir.join("bogus-free.pickle");
    std::fs::write(&path, deser_pickle::to_vec(&snapshot).unwrap()).unwrap();
    path
}

#[test]
fn frees_of_unknown_addresses_are_counted_or_fatal_with_strict() {
    let dir = scratch("strict");
    let path = write_bogus_free_trace(&dir);
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        path.as_os_str(),
    ]));
    assert_eq!(rows[0]["unknown_frees"], 1);
    assert_eq!(rows[0]["peak_active_bytes"], 2 << 20);

    let out = gmlake(&["replay".as_ref(), "--strict".as_ref(), path.as_os_str()]);
    assert_fails_naming(&out, &path, "--strict with a bogus free");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("event 3") && stderr.contains("0xdead000"),
        "{stderr}"
    );

    // The bundled traces have no such frees.
    let out = gmlake(&[
        "replay".as_ref(),
        "--strict".as_ref(),
        trace("moe-3steps-real.pickle").as_os_str(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn every_device_is_replayed_separately() {
    let dir = scratch("devices");
    let snapshot = TestSnapshot {
        device_traces: vec![
            vec![
                event("alloc", 1 << 30, 1 << 20),
                event("free_completed", 1 << 30, 1 << 20),
                event("alloc", 1 << 30, 2 << 20),
            ],
            vec![],
            // Same addresses on another device; frees only requested.
            vec![
                event("segment_alloc", 1 << 30, 20 << 20),
                event("alloc", 1 << 30, 3 << 20),
                event("alloc", 1 << 31, 5 << 20),
                event("free_requested", 1 << 30, 3 << 20),
                event("free_requested", 1 << 31, 5 << 20),
            ],
        ],
    };
    let path = dir.join("devices.pickle");
    std::fs::write(&path, deser_pickle::to_vec(&snapshot).unwrap()).unwrap();
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        path.as_os_str(),
    ]));
    let figures: Vec<(u64, u64, u64, &str)> = rows
        .iter()
        .map(|r| {
            (
                r["device"].as_u64().unwrap(),
                r["events"].as_u64().unwrap(),
                r["peak_active_bytes"].as_u64().unwrap(),
                r["free_action"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        figures,
        vec![
            (0, 3, 2 << 20, "free_completed"),
            (2, 5, 8 << 20, "free_requested")
        ],
        "the empty device is skipped"
    );
    assert_eq!(rows[1]["native_peak_reserved_bytes"], 20u64 << 20);
    assert_eq!(rows[1]["unknown_frees"], 0);

    let empty = dir.join("no-events.pickle");
    let snapshot = TestSnapshot {
        device_traces: vec![vec![], vec![]],
    };
    std::fs::write(&empty, deser_pickle::to_vec(&snapshot).unwrap()).unwrap();
    let out = gmlake(&["replay".as_ref(), empty.as_os_str()]);
    assert_fails_naming(&out, &empty, "a snapshot without events");
    assert!(text(&out.stderr).contains("no events"));
}

#[test]
fn capacity_below_peak_active_does_not_fit() {
    let path = trace("decode.pickle");
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        "--capacity".as_ref(),
        "200MiB".as_ref(),
        path.as_os_str(),
    ]));
    let row = &rows[0];
    assert!(row["peak_active_bytes"].as_u64().unwrap() > 200 << 20);
    assert_eq!(row["capacity_bytes"], 200u64 << 20);
    assert_eq!(row["fits"], false);
    assert!(row["ooms"].as_u64().unwrap() > 0);
    assert_eq!(row["native_fits"], false);
    assert!(row["peak_reserved_bytes"].as_u64().unwrap() <= 200 << 20);

    // Enough room: it fits, and native (402 MiB) does not fit in 350 MiB.
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        "--capacity".as_ref(),
        "350MiB".as_ref(),
        path.as_os_str(),
    ]));
    assert_eq!(rows[0]["fits"], true);
    assert_eq!(rows[0]["native_fits"], false);

    let out = gmlake(&[
        "replay".as_ref(),
        "--capacity".as_ref(),
        "200MiB".as_ref(),
        path.as_os_str(),
    ]);
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("native fits") && stdout.contains("no ("),
        "{stdout}"
    );
    assert!(stdout.contains("does not fit in 200.0 MiB"), "{stdout}");
}

#[test]
fn settings_are_applied_and_invalid_ones_rejected() {
    let path = trace("decode.pickle");
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        "--set".as_ref(),
        "stitch_strategy=largest_first".as_ref(),
        "--set".as_ref(),
        "fragLimit=4MiB".as_ref(),
        path.as_os_str(),
    ]));
    assert_eq!(rows[0]["config"]["stitch_strategy"], "largest_first");
    assert_eq!(rows[0]["config"]["fragLimit"], (4u64 << 20).to_string());

    for bad in ["defragLevel=high", "nonsense=1", "fragLimit"] {
        let out = gmlake(&[
            "replay".as_ref(),
            "--set".as_ref(),
            bad.as_ref(),
            path.as_os_str(),
        ]);
        assert!(!out.status.success(), "{bad}");
        let stderr = text(&out.stderr);
        let key = bad.split('=').next().unwrap();
        assert!(stderr.contains(key), "{bad}: {stderr}");
        if let Some((_, value)) = bad.split_once('=') {
            assert!(stderr.contains(value), "{bad}: {stderr}");
        }
    }
}

#[test]
fn plot_writes_an_svg_chart() {
    let dir = scratch("plot");
    let svg = dir.join("chart.svg");
    let out = gmlake(&[
        "replay".as_ref(),
        "--plot".as_ref(),
        svg.as_os_str(),
        "--capacity".as_ref(),
        "40GiB".as_ref(),
        trace("stress.pickle").as_os_str(),
        trace("decode.pickle").as_os_str(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(chart.starts_with("<svg"));
    for label in [
        "stress.pickle device 0",
        "decode.pickle device 0",
        "native reserved",
        "gmlake reserved",
        "active (trace)",
        "capacity",
    ] {
        assert!(chart.contains(label), "no {label:?} in the chart");
    }
}

#[test]
fn trace_only_reports_the_traces_own_figures() {
    let path = trace("moe-3steps-real.pickle");
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        "--trace-only".as_ref(),
        path.as_os_str(),
    ]));
    let row = &rows[0];
    assert_eq!(row["peak_reserved_bytes"], Value::Null);
    assert_eq!(
        row["peak_active_bytes"].as_u64().unwrap(),
        peak_active(&read_snapshot(&path))[0]
    );
    // The README's figure for this trace: native utilization 0.728.
    let native = row["native_utilization"].as_f64().unwrap();
    assert!((native - 0.728).abs() < 0.001, "{native}");
}

/// `--set KEY=VALUE` for each of `set`.
fn set_args<'a>(set: &[&'a str]) -> Vec<&'a str> {
    set.iter().flat_map(|s| ["--set", s]).collect()
}

/// Driver calls of the second half of a replay, and the row.
fn second_half(name: &str, set: &[&str]) -> (u64, Value) {
    let row = replay_row(name, &set_args(set));
    let n = row["driver_calls_second_half"]
        .as_u64()
        .expect("second-half calls");
    (n, row)
}

#[test]
fn steady_state_driver_calls_are_reported_and_kept_mappings_cut_them() {
    // The GPT trace (activation checkpointing, sequence length drawn per step): once warm,
    // its steps reuse kept stitched ranges. Without kept mappings (max_aliases 0) every step
    // stitches anew: an order of magnitude more calls, over the trace and three jittered
    // copies (medians; one layout may be unlucky: the trace itself makes 786 against 7,353
    // with tails last, its copies 26-170 against 749-7,989).
    let (with, row) = second_half("gpt-ckpt.pickle", &[]);
    let median = |set: &[&str]| {
        jittered_row("gpt-ckpt.pickle", &set_args(set), 3)["jitter"]["driver_calls_second_half"]
            ["median"]
            .as_f64()
            .unwrap()
    };
    let (kept, not_kept) = (median(&[]), median(&["max_aliases=0"]));
    let total = row["driver_calls"]["total"].as_u64().unwrap();
    assert!(with <= total);
    assert!(
        kept * 10.0 < not_kept,
        "second half (medians): {kept} calls kept, {not_kept} not"
    );
    let per_1k = row["driver_calls_per_1k_events_second_half"]
        .as_f64()
        .unwrap();
    let events = row["events"].as_u64().unwrap();
    let want = with as f64 * 1000.0 / (events - events / 2) as f64;
    assert!((per_1k - want).abs() < 1e-6);
    let (idle, busy) = (
        row["driver_ms_idle_second_half"].as_f64().unwrap(),
        row["driver_ms_busy_second_half"].as_f64().unwrap(),
    );
    assert!(idle >= 0.0 && busy >= idle, "{idle} {busy}");
    // The utilization is kept.
    assert!(row["utilization"].as_f64().unwrap() >= 0.99);
}

/// The two-stream FSDP2 offload job (all-gathers on their own stream): the replay of its
/// native trace predicts the reserved memory gmlake had on the GPU in a run of the same job
/// (tests/traces/fsdp-offload.gpu.json, measured on an H100) within 2%, and the native
/// reserved memory the trace's segment events add up to is what native reported there.
#[test]
fn replay_predicts_the_gpu_for_the_two_stream_fsdp_job() {
    replay_predicts_the_gpu("fsdp-offload");
}

/// DeepSpeed ZeRO-3 with LoRA and recomputation, rank 0 of two (issue 17): 11% of its frees
/// wait for another stream (`free_requested` and `free_completed` apart: the all-gather and
/// reduce-scatter buffers), and the replay still predicts the GPU's reserved memory.
#[test]
fn replay_predicts_the_gpu_for_the_two_rank_zero3_job() {
    replay_predicts_the_gpu("zero3-lr-rank0");
}

/// Full fine-tuning with recomputation, rank 0 of four (H200s; issue 17): three streams, a
/// third of the frees waiting for another stream; the replay predicts the GPU's reserved memory.
#[test]
fn replay_predicts_the_gpu_for_the_four_rank_zero3_job() {
    replay_predicts_the_gpu("zero3-r-4gpu-rank0");
}

/// Full fine-tuning without recomputation, rank 0 of four (H200s; issue 17): a 50 GiB peak on
/// three streams, and the replay predicts the GPU's reserved memory (0.998 both).
#[test]
fn replay_predicts_the_gpu_for_the_four_rank_zero3_n_job() {
    replay_predicts_the_gpu("zero3-n-4gpu-rank0");
}

/// Full fine-tuning with recomputation, rank 0 of two (H200s; issue 17): the job where gmlake
/// still re-stitches every step (about 700 VMM calls a step on the GPU with the default's
/// 8 MiB pages, 1,500 with 4 MiB); the replay predicts the GPU's reserved memory with either
/// page (both runs in one GPU call), so that this can be worked on without a GPU.
#[test]
fn replay_predicts_the_gpu_for_the_two_rank_zero3_r_job() {
    let (_, gpu) = replay_matches_the_gpu("zero3-r-2gpu-rank0");
    let run = &gpu["runs"]["gmlake_page_upgrade_size_4MiB"];
    assert_eq!(run["page_size"], 4 << 20);
    let want = run["peak_reserved_bytes"].as_f64().unwrap();
    let row = replay_row(
        "zero3-r-2gpu-rank0.pickle.gz",
        &["--set", "page_upgrade_size=4MiB"],
    );
    assert_eq!(row["page_upgrade"]["page_size"], 4 << 20);
    let ours = row["peak_reserved_bytes"].as_f64().unwrap();
    assert!(
        (ours - want).abs() / want <= 0.02,
        "4 MiB pages: replay reserved {ours} vs GPU {want}"
    );
}

/// FSDP2 on two GPUs (issue 13): the all-gather stream always has work queued, so the fences
/// the compute stream records there are pending when it misses; `cross_stream_wait` (on by
/// default) takes those pages behind a device-side wait. The GPU then reserved 2.70 GB
/// (0.992), and 2.72 GB (0.9825) at 300 steps with `replace_min_pages` (2026-11-28), which
/// the replay, by default, predicts to the byte (the test allows 2%).
#[test]
fn replay_predicts_the_gpu_for_the_two_rank_fsdp2_job() {
    replay_predicts_the_gpu("fsdp2-2rank-rank0");
}

/// `--suggest-page-size`: the largest tried page size whose utilization stays within the
/// tolerance of the replay's own and whose estimated driver time is lower; a large job (ZeRO-3
/// LR, 9.8 GB) gets one larger than 2 MiB, a small one (decode, 0.34 GB) keeps 2 MiB unless
/// the tolerance is loose; a tolerance out of [0, 1) is refused by name.
#[test]
fn suggests_a_page_size_from_replays_of_larger_pages() {
    let chosen = |row: &Value, tol: f64| {
        let s = &row["page_size_suggestion"];
        let base = row["utilization"].as_f64().unwrap();
        let base_ms = row["driver_ms_busy_second_half"].as_f64().unwrap();
        let tried = s["tried"].as_array().expect("the page sizes tried");
        assert_eq!(tried.len(), 5, "{s}");
        let expected = tried
            .iter()
            .filter(|t| {
                t["utilization"].as_f64().unwrap() >= base - tol
                    && t["driver_ms_busy_second_half"].as_f64().unwrap() < base_ms
            })
            .map(|t| t["page_size"].as_u64().unwrap())
            .max();
        assert_eq!(s["page_size"].as_u64(), expected, "{s}");
        expected
    };
    let large = replay_row("zero3-lr-rank0.pickle.gz", &["--suggest-page-size"]);
    assert!(chosen(&large, 0.01).is_some_and(|p| p > 2 << 20), "{large}");
    let small = replay_row("decode.pickle", &["--suggest-page-size"]);
    assert_eq!(chosen(&small, 0.01), None, "{small}");
    let loose = replay_row("decode.pickle", &["--suggest-page-size=0.2"]);
    assert!(chosen(&loose, 0.2).is_some(), "{loose}");
    let table = gmlake(&[
        "replay",
        "--suggest-page-size",
        trace("decode.pickle").to_str().unwrap(),
    ]);
    assert!(
        text(&table.stdout).contains("keep page_size=2.0 MiB"),
        "{}",
        text(&table.stdout)
    );
    let bad = gmlake(&[
        "replay",
        "--suggest-page-size=1.5",
        trace("decode.pickle").to_str().unwrap(),
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("--suggest-page-size"),
        "{}",
        text(&bad.stderr)
    );
}

/// DDP on two GPUs (issue 13), 300 steps on two H200s: the replay of rank 0's native trace
/// predicts the 3.46 GB gmlake reserved on the GPU within 2% (+0.18% on 2026-11-28; 3.44 GB
/// and -0.06% before `replace_min_pages`).
#[test]
fn replay_predicts_the_gpu_for_the_two_rank_ddp_job() {
    replay_predicts_the_gpu("ddp-2rank-rank0");
}

/// Caches grown by concatenation on one GPU (issue 13): the replay predicts gmlake's peak
/// within 2% (to the byte, 1,063,256,064 on an H200 on 2026-11-28, with tails first and again
/// with tails last, the default since; once a miss polls its stream's fence before giving
/// up a kept window: the GPU was 2% higher when one refusal in 296,024 allocations stitched a
/// new range instead), and its utilization meets issue 13's bar for this job, 0.95, since
/// windows under 8 pages replace no busy alias (`replace_min_pages`; 0.922 with the rule
/// before, on the GPU and in the replay), above expandable segments' (0.896). The bar is read
/// as the median over the trace and three jittered copies: one replay's peak turns on single
/// placements (0.953 and 0.947 for two cursor rules whose medians are 0.957 and 0.960).
#[test]
fn replay_predicts_the_gpu_for_the_concatenation_job() {
    let (_, gpu) = replay_matches_the_gpu("concat-cache");
    let expandable = gpu["runs"]["expandable"]["utilization"].as_f64().unwrap();
    let row = jittered_row("concat-cache.pickle.gz", &[], 3);
    let util = row["jitter"]["utilization"]["median"].as_f64().unwrap();
    assert!(
        util >= 0.95 && util > expandable,
        "median utilization {util}, expandable {expandable}"
    );
}

/// `stitch_tails_last` (the default): the concatenation job's stitches leave the tails its
/// caches grow into, so its second half settles. Over the trace and three jittered copies it
/// makes at most a few driver calls there (0, 0, 5, 0), against hundreds in every copy with
/// tails first (207-800); on an H200 the same job over 60 steps made none from step 2 to 43
/// (docs/design.md, "Stitch sources: tails last").
#[test]
fn tails_last_settles_the_concatenation_jobs_second_half() {
    let calls = |args: &[&str]| {
        let row = jittered_row("concat-cache.pickle.gz", args, 3);
        row["jitter"]["runs"]
            .as_array()
            .expect("runs")
            .iter()
            .map(|r| r["driver_calls_second_half"].as_u64().unwrap())
            .collect::<Vec<u64>>()
    };
    let last = calls(&[]);
    let first = calls(&set_args(&["stitch_tails_last=0"]));
    assert!(last.iter().all(|&c| c <= 20), "tails last: {last:?}");
    assert!(first.iter().all(|&c| c >= 100), "tails first: {first:?}");
}

/// The same job keeps every alias it makes (a 2.5 GiB job under the 128 GiB floor of kept
/// aliases): none is evicted and stitched again, so its second half makes half the
/// driver calls it made with the floor at 8 GiB (8,891 against 18,707 on this trace, where
/// 7,821 aliases were evicted).
#[test]
fn a_small_job_with_varying_shapes_keeps_its_aliases() {
    let row = replay_row("fsdp2-2rank-rank0.pickle.gz", &["--windows", "2"]);
    let windows = row["driver_calls_windows"].as_array().unwrap();
    for w in windows {
        assert_eq!(w["alias_evictions"].as_u64(), Some(0), "{w}");
    }
    let second = windows[1]["total"].as_u64().unwrap();
    assert!(second < 12_000, "{second} driver calls in the second half");
}

/// `reuse_fenced_blocks`: in the four-rank ZeRO-3 N trace, the side streams' buffers find last
/// step's kept windows once the main stream's free blocks whose own free is fenced count as
/// free, so the last two of seven windows (steps) make no VMM call, with the side streams'
/// events completing at once or pending until the next trace event (the last three before
/// `replace_min_pages`, whose windows under 8 pages take a step longer to settle); at the
/// defaults the last one re-stitches (107 VMM calls; each of the last three, 15-187 a window,
/// with the stitch order before tails last). Four H200s agreed (before tails last): 127-202
/// VMM calls a step on rank 0 at the defaults, none after the first measured step with the
/// option.
#[test]
fn reuse_fenced_blocks_leaves_the_zero3_n_steady_state_without_vmm_calls() {
    let vmm = |extra: &[&str]| -> Vec<u64> {
        let mut args = vec!["--windows", "7"];
        args.extend_from_slice(extra);
        let row = replay_row("zero3-n-4gpu-rank0.pickle.gz", &args);
        row["driver_calls_windows"]
            .as_array()
            .expect("windows")
            .iter()
            .map(|w| {
                [
                    "map",
                    "unmap",
                    "set_access",
                    "create_physical",
                    "release_physical",
                ]
                .iter()
                .map(|k| w[*k].as_u64().unwrap())
                .sum()
            })
            .collect()
    };
    for model in [&[][..], &["--busy-side-streams"][..]] {
        let with = |setting: &'static str| [model, &set_args(&[setting])[..]].concat();
        let (off, on, first) = (
            vmm(model),
            vmm(&with("reuse_fenced_blocks=1")),
            vmm(&with("stitch_tails_last=0")),
        );
        assert_eq!(&on[5..], &[0, 0], "with the option, {model:?}: {on:?}");
        assert!(off[6] > 0, "at the defaults, {model:?}: {off:?}");
        assert!(
            first[4..].iter().all(|&c| c > 0),
            "tails first, {model:?}: {first:?}"
        );
    }
}

/// The same job's driver calls: the replay makes each waiting free at its request and lets
/// its pages be reused from its completion (as the GPU's events do), so it counts the event
/// calls and re-stitches the GPU made: within 15% of the GPU's total (10% on 2026-11-25),
/// where freeing everything at completion (`--instant-frees`) is 42% short.
#[test]
fn replay_predicts_the_gpu_driver_calls_of_the_zero3_job() {
    let gpu: Value = serde_json::from_str(
        &std::fs::read_to_string(trace("zero3-lr-rank0.gpu.json")).expect("GPU figures bundled"),
    )
    .expect("GPU figures are JSON");
    let gpu_calls = &gpu["runs"]["gmlake"]["driver_calls"];
    let calls = |extra: &[&str]| {
        let row = replay_row("zero3-lr-rank0.pickle.gz", extra);
        (
            row["driver_calls"].clone(),
            row["deferred_frees"].as_u64().unwrap(),
        )
    };
    let off = |ours: &Value, kind: &str| {
        let (o, g) = (
            ours[kind].as_f64().unwrap(),
            gpu_calls[kind].as_f64().unwrap(),
        );
        (o - g).abs() / g
    };
    // The GPU figures are of 2 MiB pages throughout and of the stitch order before tails
    // last (before those defaults).
    let before = set_args(&["page_upgrade_at=off", "stitch_tails_last=0"]);
    let (deferred, n) = calls(&before);
    assert!(n > 5000, "{n} waiting frees replayed");
    assert!(
        off(&deferred, "total") <= 0.15,
        "total {deferred} vs GPU {gpu_calls}"
    );
    assert!(
        off(&deferred, "query_event") <= 0.15,
        "events {deferred} vs GPU {gpu_calls}"
    );
    let (instant, n) = calls(&[&["--instant-frees"][..], &before[..]].concat());
    assert_eq!(n, 0);
    assert!(off(&instant, "total") > 0.3, "instant frees: {instant}");
}

/// `NAME.pickle.gz` replayed: peak reserved within 2% of what gmlake reserved on the GPU in
/// the same run (`NAME.gpu.json`), native's segments exactly native's peak there, and
/// utilization at least 0.97.
fn replay_predicts_the_gpu(name: &str) {
    let (util, _) = replay_matches_the_gpu(name);
    assert!(util >= 0.97, "{name}: utilization {util}");
}

/// The replay of `name`'s native trace against its GPU figures (`name.gpu.json`): gmlake's
/// peak reserved within 2%, native's exactly. Returns the replay's utilization and the GPU
/// figures.
fn replay_matches_the_gpu(name: &str) -> (f64, Value) {
    let gpu: Value = serde_json::from_str(
        &std::fs::read_to_string(trace(&format!("{name}.gpu.json"))).expect("GPU figures bundled"),
    )
    .expect("GPU figures are JSON");
    let runs = &gpu["runs"];
    let gpu_reserved = |a: &str| runs[a]["peak_reserved_bytes"].as_f64().unwrap();
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        trace(&format!("{name}.pickle.gz")).as_os_str(),
    ]));
    let row = &rows[0];
    assert!(
        rows.iter().skip(1).all(|r| r["events"].as_u64() <= Some(1)),
        "one device with events"
    );
    let ours = row["peak_reserved_bytes"].as_f64().unwrap();
    let native = row["native_peak_reserved_bytes"].as_f64().unwrap();
    let err = (ours - gpu_reserved("gmlake")).abs() / gpu_reserved("gmlake");
    assert!(
        err <= 0.02,
        "{name}: replay reserved {ours} vs GPU {} ({:.2}% off)",
        gpu_reserved("gmlake"),
        err * 100.0
    );
    assert_eq!(
        native,
        gpu_reserved("native"),
        "{name}: native segments in the trace"
    );
    (row["utilization"].as_f64().unwrap(), gpu)
}

/// `--windows N`: the driver calls of N windows of equal event counts, which add up to the
/// whole replay's, in JSON and as table lines; a count of 0 is refused by name.
#[test]
fn windows_split_the_driver_calls_and_add_up() {
    let t = trace("decode.pickle");
    let rows = json_rows(&gmlake(&[
        "replay".as_ref(),
        "--json".as_ref(),
        "--windows".as_ref(),
        "4".as_ref(),
        t.as_os_str(),
    ]));
    let row = &rows[0];
    let w = row["driver_calls_windows"].as_array().expect("windows");
    assert_eq!(w.len(), 4);
    let events = row["events"].as_u64().unwrap();
    let mut next = 0;
    for x in w {
        assert_eq!(x["first_event"].as_u64(), Some(next));
        next += x["events"].as_u64().unwrap();
    }
    assert_eq!(next, events);
    for kind in [
        "total",
        "map",
        "set_access",
        "create_physical",
        "query_event",
    ] {
        let sum: u64 = w.iter().map(|x| x[kind].as_u64().unwrap()).sum();
        assert_eq!(sum, row["driver_calls"][kind].as_u64().unwrap(), "{kind}");
    }
    // The stitcher's counters are split the same way: which decisions made the calls.
    for counter in ["stitches", "pages_stitched"] {
        let sum: u64 = w.iter().map(|x| x[counter].as_u64().unwrap()).sum();
        assert_eq!(sum, row[counter].as_u64().unwrap(), "{counter}");
    }
    for counter in [
        "stitch_reuses",
        "pages_reused",
        "aliases_replaced",
        "alias_evictions",
    ] {
        assert!(
            w.iter().all(|x| x[counter].is_u64()),
            "{counter} in every window"
        );
    }
    assert!(
        w[0]["total"].as_u64().unwrap() > 0,
        "the first window creates memory"
    );

    let out = gmlake(&[
        "replay".as_ref(),
        "--windows".as_ref(),
        "3".as_ref(),
        t.as_os_str(),
    ]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).matches(" window ").count(), 3);
    assert_eq!(text(&out.stdout).matches("; stitches ").count(), 3);
    let out = gmlake(&[
        "replay".as_ref(),
        "--windows".as_ref(),
        "0".as_ref(),
        t.as_os_str(),
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--windows"),
        "{}",
        text(&out.stderr)
    );
}

/// FSDP2 on two GPUs keeps all-gathers queued on its side stream, so a fence the allocator
/// records there during a miss is not complete at that miss. The replay that completes every
/// event at once does not see it; `--busy-side-streams` without `cross_stream_wait` does (new
/// memory instead of the side stream's freed pages: 0.93, what the GPU showed while its waits
/// failed), and `cross_stream_wait` (the default) takes those pages behind a device-side wait:
/// the utilization of the instant model comes back with a few dozen waits (the GPU made 96 in
/// 300 steps). Utilization is read as the median over the trace and four jittered copies (the
/// trace's own layout with waits is 0.974 with tails last, its copies 0.979-0.981).
#[test]
fn busy_side_streams_show_the_fsdp2_fences_and_cross_stream_wait_takes_their_pages() {
    let run = |args: &[&str]| jittered_row("fsdp2-2rank-rank0.pickle.gz", args, 4);
    let util = |r: &Value| r["jitter"]["utilization"]["median"].as_f64().unwrap();
    let instant = run(&[]);
    let busy = run(&["--busy-side-streams", "--set", "cross_stream_wait=0"]);
    let waiting = run(&["--busy-side-streams"]);
    assert!(util(&instant) >= 0.98, "{instant}");
    assert!(util(&busy) <= 0.95, "busy side streams: {busy}");
    assert_eq!(busy["driver_calls"]["stream_wait"].as_u64(), Some(0));
    assert!(
        util(&waiting) >= 0.975 && util(&instant) - util(&waiting) < 0.005,
        "cross_stream_wait: {waiting}"
    );
    let waits = waiting["driver_calls"]["stream_wait"].as_u64().unwrap();
    assert!(waits > 0 && waits < 200, "{waits} stream waits");
    // A single-stream trace is the same under both models.
    let one = |args: &[&str]| replay_row("decode.pickle", args)["peak_reserved_bytes"].clone();
    assert_eq!(one(&[]), one(&["--busy-side-streams"]));
}

/// `gmlake ops` writes every allocation of the trace once, each freed once, and refuses a
/// device the trace does not have.
#[test]
fn ops_lists_every_allocation_once() {
    use gmlake_cli::ops::{Op, Ops};
    let dir = scratch("ops");
    let out_path = dir.join("moe.ops");
    let t = trace("moe.pickle");
    let out = gmlake(&[
        "ops".as_ref(),
        t.as_os_str(),
        "--out".as_ref(),
        out_path.as_os_str(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ops = Ops::from_bytes(&std::fs::read(&out_path).unwrap()).unwrap();
    let snapshot = read_snapshot(&t);
    let allocs = snapshot.device_traces[0]
        .iter()
        .filter(|e| e.action == "alloc")
        .count();
    assert_eq!(ops.allocs(), allocs);
    assert_eq!(ops.ops.len(), 2 * allocs);
    let first = ops.ops.iter().find_map(|o| match o {
        Op::Alloc { size, .. } => Some(*size),
        Op::Free { .. } => None,
    });
    let first_event = snapshot.device_traces[0]
        .iter()
        .find(|e| e.action == "alloc")
        .and_then(|e| e.size);
    assert_eq!(first, first_event);
    assert!(text(&out.stdout).contains(&format!("{allocs} allocations")));
    let bad = gmlake(&[
        "ops".as_ref(),
        t.as_os_str(),
        "--device".as_ref(),
        "7".as_ref(),
        "--out".as_ref(),
        out_path.as_os_str(),
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad.stderr).contains("--device 7 is not one"));
}

/// The default upgrade chooses its page from the job's blocks (`page_upgrade_size` 0): the
/// two ZeRO-3 R traces, whose large live blocks average 100-250 MiB, move to 8 MiB pages and
/// make fewer driver calls than with twice the page at 0.98 utilization or more; DDP's and
/// FSDP2's (25 MiB blocks) move to twice the page, as before.
#[test]
fn the_default_upgrade_sizes_pages_by_the_jobs_blocks() {
    let calls = |r: &Value| r["driver_calls"]["total"].as_u64().unwrap();
    let util = |r: &Value| r["utilization"].as_f64().unwrap();
    for t in [
        "zero3-r-2gpu-rank0.pickle.gz",
        "zero3-r-4gpu-rank0.pickle.gz",
    ] {
        let auto = replay_row(t, &[]);
        let twice = replay_row(t, &["--set", "page_upgrade_size=4MiB"]);
        assert_eq!(auto["page_upgrade"]["page_size"], 8 << 20, "{t}");
        assert_eq!(twice["page_upgrade"]["page_size"], 4 << 20, "{t}");
        assert!(
            calls(&auto) < calls(&twice),
            "{t}: {} driver calls, {} with 4 MiB pages",
            calls(&auto),
            calls(&twice)
        );
        assert!(util(&auto) >= 0.98, "{t}: {}", util(&auto));
    }
    for t in ["ddp-2rank-rank0.pickle.gz", "fsdp2-2rank-rank0.pickle.gz"] {
        let auto = replay_row(t, &[]);
        assert_eq!(auto["page_upgrade"]["upgraded"], true, "{t}");
        assert_eq!(auto["page_upgrade"]["page_size"], 4 << 20, "{t}");
    }
}

/// `--upgrade-pages AT:PAGE` (the core's `page_upgrade_at`, `page_upgrade_size`): a job that
/// never holds AT bytes (decode, 0.34 GB) replays as without it; so does one that holds them
/// but re-maps little (gpt-ckpt, 23 GB: its steps repeat), under the default
/// `page_upgrade_remap`; one that re-maps (stress, 33 GB) moves to the larger pages (at once,
/// or with `page_upgrade_remap` 1; by default it is too short to pay for the switch), and with
/// the upgrade at once makes far fewer driver calls at nearly the same utilization; the JSON
/// names the setting. A page that is no power of two is refused, naming the option.
#[test]
fn upgrade_pages_replays_a_page_size_upgrade() {
    let calls = |r: &Value| r["driver_calls"]["total"].as_u64().unwrap();
    let util = |r: &Value| r["utilization"].as_f64().unwrap();
    let off = ["--set", "page_upgrade_at=off"];
    // A job below the threshold (decode) and one that re-maps little (gpt-ckpt).
    for t in ["decode.pickle", "gpt-ckpt.pickle"] {
        let without = replay_row(t, &off);
        let with = replay_row(t, &["--upgrade-pages", "1GiB:8MiB"]);
        assert_eq!(
            without["peak_reserved_bytes"], with["peak_reserved_bytes"],
            "{t}"
        );
        assert_eq!(calls(&without), calls(&with), "{t}");
        assert_eq!(with["page_upgrade"]["upgraded"], false, "{t}");
        assert!(without.get("page_upgrade").is_none(), "{t}");
    }
    // The default: at 1 GiB, to twice the page.
    let default = replay_row("decode.pickle", &[]);
    assert_eq!(default["config"]["page_upgrade_at"], "1073741824");
    assert_eq!(default["config"]["page_upgrade_size"], "0");
    assert_eq!(default["page_upgrade"]["upgraded"], false);
    let at_once = [
        "--upgrade-pages",
        "1GiB:8MiB",
        "--set",
        "page_upgrade_remap=0",
    ];
    let large = replay_row("stress.pickle", &off);
    let large_up = replay_row("stress.pickle", &at_once);
    assert!(
        calls(&large_up) * 2 < calls(&large),
        "{} driver calls with the upgrade, {} without",
        calls(&large_up),
        calls(&large)
    );
    assert!(
        util(&large_up) > util(&large) - 0.03 && util(&large_up) <= 1.0,
        "{} against {}",
        util(&large_up),
        util(&large)
    );
    assert_eq!(large_up["config"]["page_upgrade_at"], "1073741824");
    assert_eq!(large_up["config"]["page_upgrade_size"], "8388608");
    assert_eq!(large_up["config"]["page_upgrade_remap"], "0");
    assert_eq!(large_up["page_upgrade"]["upgraded"], true);
    assert_eq!(large_up["page_upgrade"]["page_size"], 8 << 20);
    assert!(large_up["page_upgrade"]["pages_drained"].as_u64().unwrap() > 0);
    // With `page_upgrade_remap` 1 the stress job switches later, once it has re-mapped what
    // it holds (`--windows` counts the stitches the summary counts); under the default (2,
    // the switch's cost: giving back and creating again) this short random run never pays
    // that much, and keeps its pages.
    let windowed = replay_row(
        "stress.pickle",
        &[
            "--upgrade-pages",
            "1GiB:8MiB",
            "--set",
            "page_upgrade_remap=1",
            "--windows",
            "3",
        ],
    );
    assert_eq!(windowed["config"]["page_upgrade_remap"], "1");
    let by_default = replay_row("stress.pickle", &[]);
    assert_eq!(by_default["config"]["page_upgrade_remap"], "2");
    assert_eq!(by_default["page_upgrade"]["upgraded"], false);
    assert_eq!(
        by_default["peak_reserved_bytes"],
        large["peak_reserved_bytes"]
    );
    assert_eq!(windowed["page_upgrade"]["upgraded"], true);
    assert!(
        util(&windowed) < util(&large),
        "{} against {}: the upgrade did not happen",
        util(&windowed),
        util(&large)
    );
    let in_windows: u64 = windowed["driver_calls_windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["stitches"].as_u64().unwrap())
        .sum();
    assert_eq!(
        Some(in_windows),
        windowed["stitches"].as_u64(),
        "{windowed}"
    );
    let t = trace("decode.pickle");
    let bad = gmlake(&[
        "replay".as_ref(),
        "--upgrade-pages".as_ref(),
        "1GiB:3MiB".as_ref(),
        t.as_os_str(),
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("--upgrade-pages"),
        "{}",
        text(&bad.stderr)
    );
}

/// `--call-times`: one duration per allocation and per free the replay makes (the decode
/// trace allocates and frees each of its blocks once: as many frees as allocations, half the
/// events between them with the completions), ordered percentiles, and asking changes no
/// decision.
#[test]
fn call_times_time_every_allocation_and_free_without_changing_a_decision() {
    let plain = replay_row("decode.pickle", &[]);
    let row = replay_row("decode.pickle", &["--call-times"]);
    assert!(plain.get("call_times").is_none());
    for k in ["peak_reserved_bytes", "driver_calls"] {
        assert_eq!(row[k], plain[k], "{k} changed with --call-times");
    }
    let t = &row["call_times"];
    let (a, f) = (&t["alloc"], &t["free"]);
    let n = a["count"].as_u64().unwrap();
    assert!(n > 1000, "{t}");
    assert_eq!(f["count"].as_u64().unwrap(), n, "{t}");
    assert!(2 * n <= row["events"].as_u64().unwrap(), "{t}");
    for d in [a, f] {
        let q: Vec<u64> = ["p50_ns", "p90_ns", "p99_ns", "max_ns"]
            .iter()
            .map(|k| d[*k].as_u64().unwrap())
            .collect();
        assert!(q.windows(2).all(|w| w[0] <= w[1]) && q[0] > 0, "{d}");
        assert!(d["mean_ns"].as_f64().unwrap() <= q[3] as f64, "{d}");
        let total = d["total_ms"].as_f64().unwrap();
        let mean_total = d["mean_ns"].as_f64().unwrap() * d["count"].as_f64().unwrap() / 1e6;
        assert!((total - mean_total).abs() <= 1e-6 * total.max(1.0), "{d}");
        assert!(d["slow_ms"].as_f64().unwrap() <= total, "{d}");
    }
    // The second half: the later half of the calls, in call order.
    for (all, half) in [(a, &t["alloc_second_half"]), (f, &t["free_second_half"])] {
        let (n, h) = (
            all["count"].as_u64().unwrap(),
            half["count"].as_u64().unwrap(),
        );
        assert_eq!(h, n - n / 2, "{t}");
        assert!(half["total_ms"].as_f64().unwrap() <= all["total_ms"].as_f64().unwrap());
    }
}

/// `--misses` on the two-rank FSDP2 trace with busy side streams (whose steady state still
/// maps, as the GPU's does): the second half's misses are reported with the best window's
/// busy pages split by holder (the split adds up), at most 20 listed, each listed one from
/// the second half; and asking changes no decision (same peak, same driver calls).
#[test]
fn misses_report_the_second_halfs_misses_without_changing_a_decision() {
    let args = ["--busy-side-streams"];
    let plain = replay_row("fsdp2-2rank-rank0.pickle.gz", &args);
    let row = replay_row(
        "fsdp2-2rank-rank0.pickle.gz",
        &["--busy-side-streams", "--misses"],
    );
    assert!(plain.get("misses_second_half").is_none());
    for k in ["peak_reserved_bytes", "driver_calls"] {
        assert_eq!(row[k], plain[k], "{k} changed with --misses");
    }
    let m = &row["misses_second_half"];
    let n = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k} in {m}"));
    assert!(n("count") > 0 && n("with_window") <= n("count"), "{m}");
    let held: u64 = [
        "held_live_same_stream",
        "held_live_other_stream",
        "held_free_unfenced",
        "held_other",
    ]
    .iter()
    .map(|k| n(k))
    .sum();
    assert_eq!(held, n("busy"), "{m}");
    let first = m["first"].as_array().unwrap();
    assert!(!first.is_empty() && first.len() <= 20, "{m}");
    let half = row["events"].as_u64().unwrap() / 2;
    for f in first {
        assert!(f["event"].as_u64().unwrap() >= half, "{f}");
        if let Some(b) = f["best_busy"].as_array() {
            let v: Vec<u64> = b.iter().map(|x| x.as_u64().unwrap()).collect();
            assert_eq!(v[0], v[1..].iter().sum::<u64>(), "{f}");
        }
    }
}

/// `--jitter N`: the trace and N copies with each allocation slightly larger are replayed;
/// the first run is the trace's own (its figures are the row's), the spreads are the
/// median and range of all N + 1, and each copy is a different job (the decode trace's
/// copies replay at utilizations 0.02 apart: a layout that single decisions decide; with the
/// stitch order before tails last the trace's own was above all its copies'). A count out of
/// 1-64 is refused by name.
#[test]
fn jitter_replays_copies_and_reports_the_spread() {
    let row = replay_row("decode.pickle", &["--jitter", "4"]);
    let j = &row["jitter"];
    assert_eq!(j["copies"].as_u64(), Some(4), "{j}");
    let runs = j["runs"].as_array().expect("the runs");
    assert_eq!(runs.len(), 5, "{j}");
    assert_eq!(runs[0]["seed"].as_u64(), Some(0));
    assert_eq!(runs[0]["utilization"], row["utilization"], "{j}");
    assert_eq!(
        runs[0]["driver_calls_second_half"], row["driver_calls_second_half"],
        "{j}"
    );
    let utils: Vec<f64> = runs
        .iter()
        .map(|r| r["utilization"].as_f64().unwrap())
        .collect();
    let mut sorted = utils.clone();
    sorted.sort_by(f64::total_cmp);
    let u = &j["utilization"];
    assert_eq!(u["min"].as_f64(), Some(sorted[0]), "{j}");
    assert_eq!(u["max"].as_f64(), Some(sorted[4]), "{j}");
    assert_eq!(u["median"].as_f64(), Some(sorted[2]), "{j}");
    assert!(
        sorted[4] - sorted[0] > 0.01,
        "the copies are different jobs: {utils:?}"
    );
    // The same seeds give the same copies.
    let again = replay_row("decode.pickle", &["--jitter", "4"]);
    assert_eq!(again["jitter"]["runs"], j["runs"]);

    let table = gmlake(&[
        "replay",
        "--jitter",
        "2",
        trace("decode.pickle").to_str().unwrap(),
    ]);
    assert!(
        text(&table.stdout).contains("over the trace and 2 jittered copies"),
        "{}",
        text(&table.stdout)
    );
    for bad in ["0", "65", "many"] {
        let out = gmlake(&[
            "replay",
            "--jitter",
            bad,
            trace("decode.pickle").to_str().unwrap(),
        ]);
        assert_eq!(out.status.code(), Some(2), "--jitter {bad}");
        assert!(
            text(&out.stderr).contains("--jitter"),
            "{}",
            text(&out.stderr)
        );
    }
}
