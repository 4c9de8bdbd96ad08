"""bench/dist-gpu.sh's CONFS: one gmlake run per ';'-separated configuration, in order, an
empty entry meaning the defaults (wherever it stands), between native and native again. A
shim `python3` on PATH records each torchrun launch instead of starting one."""
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


def launches(tmp_path, confs, modes="fsdp"):
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "python3"
    shim.write_text(SHIM.replace("{real}", sys.executable))
    shim.chmod(0o755)
    log = tmp_path / "launches.jsonl"
    env = dict(os.environ, PATH=f"{shim_dir}:{os.environ['PATH']}", SHIM_LOG=str(log),
               OUT=str(tmp_path / "out"), MODES=modes, CONFS=confs)
    env.pop("GMLAKE_CONF", None)
    r = subprocess.run(["bash", str(BENCH / "dist-gpu.sh"), str(tmp_path / "lib.so")], env=env,
                       capture_output=True, text=True, timeout=60)
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


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))
