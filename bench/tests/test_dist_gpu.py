"""bench/dist-gpu.sh's CONFS: one gmlake run per ';'-separated configuration, in order, an
empty entry meaning the defaults (wherever it stands), between native and native again,
REPEAT passes of that; a shim `python3` on PATH records each torchrun launch instead of
starting one. And bench/dist_summary.py's pass-by-pass comparison."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]

SHIM = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then
  gm=0; for a in "$@"; do [ "$a" = gmlake ] && gm=1; done
  printf '{"run": "%s", "gmlake": %s, "conf": "%s"}\\n' "$GMLAKE_DIST_RUN" "$gm" "$GMLAKE_CONF" >>"$SHIM_LOG"
  exit 0
fi
exec {real} "$@"
"""


def run_script(tmp_path, confs, modes, repeat):
    """Runs dist-gpu.sh with the shim first on PATH: (the process, the shim's launch log)."""
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "python3"
    shim.write_text(SHIM.replace("{real}", sys.executable))
    shim.chmod(0o755)
    log = tmp_path / "launches.jsonl"
    env = dict(os.environ, PATH=f"{shim_dir}:{os.environ['PATH']}", SHIM_LOG=str(log),
               OUT=str(tmp_path / "out"), MODES=modes, CONFS=confs, REPEAT=repeat)
    env.pop("GMLAKE_CONF", None)
    r = subprocess.run(["bash", str(BENCH / "dist-gpu.sh"), str(tmp_path / "lib.so")], env=env,
                       capture_output=True, text=True, timeout=60)
    return r, log


def launches(tmp_path, confs, modes="fsdp", repeat="1"):
    r, log = run_script(tmp_path, confs, modes, repeat)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_trailing_empty_configuration_is_a_run_at_the_defaults(tmp_path):
    runs = launches(tmp_path, "reuse_fenced_blocks:1;")
    assert [(r["run"], r["gmlake"], r["conf"]) for r in runs] == [
        ("-native", 0, ""), ("-g0", 1, "reuse_fenced_blocks:1"), ("-g1", 1, ""),
        ("-native2", 0, "")]


def test_a_leading_empty_configuration_and_two_jobs(tmp_path):
    runs = launches(tmp_path, ";page_upgrade_at:1GiB", modes="fsdp ddp")
    assert [(r["run"], r["conf"]) for r in runs] == [
        ("-native", ""), ("-g0", ""), ("-g1", "page_upgrade_at:1GiB"), ("-native2", ""),
    ] * 2


def test_one_configuration(tmp_path):
    runs = launches(tmp_path, "host_timing:1")
    assert [(r["run"], r["conf"]) for r in runs] == [
        ("-native", ""), ("-g0", "host_timing:1"), ("-native2", "")]


def test_repeat_names_each_pass(tmp_path):
    runs = launches(tmp_path, ";reuse_fenced_blocks:1", modes="fsdp", repeat="2")
    assert [r["run"] for r in runs] == [
        "-native", "-g0", "-g1", "-native2", "-native-p2", "-g0-p2", "-g1-p2", "-native2-p2"]


def test_a_bad_repeat_is_named_and_nothing_runs(tmp_path):
    r, log = run_script(tmp_path, "", "fsdp", "two")
    assert r.returncode == 2 and "REPEAT" in r.stdout and "two" in r.stdout
    assert not log.exists()


def record(folder, fname, step, util=0.98, calls=None, host_ns=None, conf=""):
    d = {"utilization": util, "median_step_ms": step, "peak_reserved": 1, "losses": [1.0]}
    if calls is not None:
        d["after_warmup_per_step"] = {"gmlake.driver_calls": calls}
        if host_ns is not None:
            d["after_warmup_per_step"]["gmlake.host_ns_alloc"] = host_ns
        d["gmlake_conf"] = conf
    (folder / fname).write_text(json.dumps(d))


def test_the_summary_compares_each_gmlake_run_with_its_own_pass(tmp_path):
    sys.path.insert(0, str(BENCH))
    import dist_summary

    # Pass 1: natives 100 and 90 ms, gmlake 99 (1.1x the faster, 1.0436x their geometric
    # mean); pass 2: the host is slower, natives 150 and 160, gmlake 165 (1.1x the faster,
    # 1.0651x the mean). The faster of two native runs reads gmlake slower than it is: the
    # mean is the measure. Against the other pass's natives it would read 1.74x or 0.64x.
    # Pass 3 has no native run: left out.
    record(tmp_path, "fsdp-native-native-rank0.json", 100)
    record(tmp_path, "fsdp-gmlake-g0-rank0.json", 99, calls=70, host_ns=6e6, conf="host_timing:1")
    record(tmp_path, "fsdp-native-native2-rank0.json", 90)
    record(tmp_path, "fsdp-native-native-p2-rank0.json", 150)
    record(tmp_path, "fsdp-gmlake-g0-p2-rank0.json", 165, calls=80, host_ns=7e6, conf="host_timing:1")
    record(tmp_path, "fsdp-native-native2-p2-rank0.json", 160)
    record(tmp_path, "fsdp-gmlake-g0-p3-rank0.json", 500, calls=90, conf="host_timing:1")
    runs = dist_summary.load(str(tmp_path))
    r = dist_summary.rounds(runs)
    assert sorted(p for p, _ in r[("fsdp", "g0")][0]) == [1, 2]
    got = dict(r[("fsdp", "g0")][0])
    assert abs(got[1] - 99 / (100 * 90) ** 0.5) < 1e-9 and abs(got[2] - 165 / (150 * 160) ** 0.5) < 1e-9, got
    table = dist_summary.round_table(runs)
    row = [line for line in table if line.startswith("| fsdp | g0 |")]
    assert row == ["| fsdp | g0 | host_timing:1 | 0 | 2 | 1.054 | 1.044-1.065 | 0.980 | 70-80 "
                   "| 6.0-7.0 |"], table


def test_the_summary_names_a_folder_without_runs(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / "dist_summary.py"), str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no run files" in r.stderr and "none" in r.stderr


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))
