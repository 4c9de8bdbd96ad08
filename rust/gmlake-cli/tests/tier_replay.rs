//! `gmlake tier-replay` end to end: a trace file and the synthetic job, table and JSON.

use gmlake_core::tier_trace;
use serde_json::Value;
use std::process::Command;

fn gmlake(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gmlake"))
        .args(args)
        .output()
        .expect("running gmlake")
}

#[test]
fn replays_a_trace_file_with_both_policies() {
    let dir = std::env::temp_dir().join(format!("gmlake-tier-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("fwd-bwd.txt");
    std::fs::write(
        &path,
        tier_trace::write(&tier_trace::forward_backward(8, 2)),
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let out = gmlake(&["tier-replay", p, "--budget", "26MiB", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["policy"], "lru");
    assert_eq!(rows[1]["policy"], "aware");
    let moved =
        |r: &Value| r["bytes_to_host"].as_u64().unwrap() + r["bytes_to_device"].as_u64().unwrap();
    assert!(moved(&rows[1]) < moved(&rows[0]));
    for r in &rows {
        assert!(r["peak_tier_device_bytes"].as_u64().unwrap() <= 26 << 20);
        assert!(r["peak_reserved"].as_u64() < r["peak_reserved_without_tier"].as_u64());
        assert_eq!(r["failed"], 0);
    }
    // Table output, the synthetic job, one policy.
    let out = gmlake(&["tier-replay", "--fwd-bwd", "4,1", "--policy", "lru"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("fwd-bwd 4x1") && text.contains("lru") && !text.contains("aware"));
    // A bad trace: exit status 1, the line named.
    std::fs::write(&path, "create 1 1MiB 0\nfly 1\n").unwrap();
    let out = gmlake(&["tier-replay", p]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
    let _ = std::fs::remove_dir_all(&dir);
}
