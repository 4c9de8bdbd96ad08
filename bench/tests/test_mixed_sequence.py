"""bench/mixed_sequence.cpp (bench/latency.cpp's random mixed sequence, written to a file) and
its replay by rust/gmlake-core/examples/mixed_calls.rs (MIXED_SEQUENCE=FILE). No GPU, no torch.

Run: python3 -m pytest -q bench/tests
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    exe = tmp_path_factory.mktemp("seq") / "mixed_sequence"
    subprocess.run(["g++", "-O1", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
                    str(BENCH / "mixed_sequence.cpp")], check=True)
    return exe


def write(generator, path, *args):
    return subprocess.run([str(generator), "--out", str(path), *args], capture_output=True, text=True)


def words(path):
    data = path.read_bytes()
    return struct.unpack(f"<{len(data) // 8}Q", data)


def test_the_file_holds_the_fill_and_every_pair(generator, tmp_path):
    f = tmp_path / "s.bin"
    r = write(generator, f, "--mixed-live", "200", "--mixed-ops", "2000", "--mixed-max", "4194304")
    assert r.returncode == 0, r.stderr
    w = words(f)
    live, warm, ops, sampled = w[:4]
    # latency.cpp's rule: warm-up max(ops / 5, 4 live), sampled min(ops / 5, 200k).
    assert (live, warm, ops, sampled) == (200, 800, 2000, 400)
    assert len(w) == 4 + live + 2 * (warm + ops + sampled)
    fill = w[4:4 + live]
    pairs = w[4 + live:]
    assert all(512 <= s <= 4194304 for s in fill + pairs[1::2])
    assert all(i < live for i in pairs[0::2])
    assert len(set(pairs[0::2])) > live // 2, "indices spread over the live blocks"


def test_a_seed_gives_one_sequence(generator, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for p, seed in ((a, "42"), (b, "42"), (c, "7")):
        assert write(generator, p, "--seed", seed, "--mixed-live", "50", "--mixed-ops", "500").returncode == 0
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("args, message", [
    (["--mixed-ops", "many"], "--mixed-ops takes a number, not 'many'"),
    (["--mixed-live", "0"], "usage"),
    (["--mixed-min", "4096", "--mixed-max", "512"], "usage"),
    (["--speed", "3"], "unknown option --speed"),
    (["--seed"], "--seed needs a value"),
])
def test_bad_arguments_are_named(generator, tmp_path, args, message):
    r = write(generator, tmp_path / "x", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert not (tmp_path / "x").exists()


def mixed_calls():
    for p in (ROOT / "target/release/examples/mixed_calls", ROOT / "target/debug/examples/mixed_calls"):
        if p.exists():
            return p
    pytest.skip("mixed_calls not built (cargo build -p gmlake-core --example mixed_calls)")


def test_mixed_calls_replays_the_file(generator, tmp_path):
    exe = mixed_calls()
    f = tmp_path / "s.bin"
    assert write(generator, f, "--mixed-live", "300", "--mixed-ops", "3000").returncode == 0
    env = dict(os.environ, MIXED_SEQUENCE=str(f))
    r = subprocess.run([str(exe), "5", "7"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # The file's live blocks and timed pairs, not the arguments.
    assert "mixed live=300 ops=3000:" in r.stdout
    again = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=300)
    calls = lambda out: out.split("calls ")[1].split(" ")[0]  # noqa: E731
    assert calls(again.stdout) == calls(r.stdout), "the same sequence, the same driver calls"


def test_mixed_calls_names_a_bad_file(generator, tmp_path):
    exe = mixed_calls()
    f = tmp_path / "s.bin"
    assert write(generator, f, "--mixed-live", "10", "--mixed-ops", "100").returncode == 0
    data = f.read_bytes()
    cases = {
        "short.bin": (data[:20], "not whole u64 words"),
        "cut.bin": (data[:-16], "but its header"),
        # The first warm-up pair frees block 10 of 10.
        "index.bin": (data[:14 * 8] + struct.pack("<Q", 10) + data[15 * 8:], "frees block 10 of 10"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        r = subprocess.run([str(exe)], env=dict(os.environ, MIXED_SEQUENCE=str(bad)),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        assert message in r.stderr, (name, r.stderr)
