"""bench/machine_check.py: one JSON line with the host's loop time (and GPU rates where CUDA is
there), appended to --out."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def test_machine_check_writes_one_line(tmp_path):
    out = tmp_path / "machine.jsonl"
    for _ in range(2):
        r = subprocess.run([sys.executable, str(BENCH / "machine_check.py"), "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[-1])
    assert rec["kind"] == "machine_check"
    assert rec["host_loop_ms"] > 0
    assert isinstance(rec["gpu_bf16_tflops"], list)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == rec
