"""bench/cost_check.py: the cost model's figures read from cost.rs, and the check's table on
synthetic records (no torch, no GPU).

Run: python3 -m pytest -q bench/tests
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
import cost_check  # noqa: E402


def test_every_charged_kind_has_a_figure_in_cost_rs():
    table = cost_check.costs()
    assert set(cost_check.KINDS) <= set(table)
    for idle, busy in table.values():
        assert 0 < idle <= busy


def test_the_model_charges_every_call_kind_the_allocator_counts():
    stats = (BENCH.parent / "rust/gmlake-core/src/stats.rs").read_text()
    block = stats[stats.index("pub fn as_pairs"):]
    block = block[block.index("{"):block.index("\n        ]")]
    counted = set(re.findall(r'\("(\w+)", self\.\w+\)', block))
    assert len(counted) == 12
    assert cost_check.CALL_KINDS == counted


def test_estimate_charges_each_kind_at_its_figure():
    table = cost_check.costs()
    kinds = {"map": 100, "set_access": 4, "create_physical": 10, "unmap": 3, "record_event": 2,
             "total": 119, "map_alias": 0}
    idle, busy = cost_check.estimate_ms(kinds, table)
    want = sum(n * table[c][1] for c, n in
               [("MAP", 100), ("SET_ACCESS", 4), ("CREATE", 10), ("UNMAP", 3), ("EVENT", 2)]) / 1000
    assert abs(busy - want) < 1e-9
    assert idle < busy
    assert cost_check.estimate_ms({}, table) == (0.0, 0.0)


def test_table_compares_the_step_lost_with_the_estimate(tmp_path, capsys):
    recs = [
        {"workload": "stress", "allocator": "native", "median_step_s": 0.0030},
        {"workload": "stress", "allocator": "expandable", "median_step_s": 0.0025},
        {"workload": "stress", "allocator": "gmlake", "median_step_s": 0.0125,
         "driver_calls_per_step": [200, 200], "driver_calls_by_kind": {"map": 360, "set_access": 40}},
        {"workload": "stress", "allocator": "native2", "median_step_s": 0.0031},
    ]
    p = tmp_path / "r.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cost_check.main([str(p)])
    out = capsys.readouterr().out.splitlines()
    row = [line for line in out if "gmlake" in line]
    assert len(row) == 1
    table = cost_check.costs()
    busy_per_step = (180 * table["MAP"][1] + 20 * table["SET_ACCESS"][1]) / 1000
    cols = row[0].split()
    assert cols[2:4] == ["2", "200"]
    assert abs(float(cols[4]) - 10.0) < 0.01, "lost: 12.5 ms against expandable's 2.5"
    assert abs(float(cols[6]) - busy_per_step) < 0.01


def test_the_random_mixed_pattern_is_checked_against_native(tmp_path, capsys):
    recs = [
        {"kind": "latency", "test": "mixed", "allocator": "native", "ns_per_pair": 1000.0,
         "ops_pairs": 1000},
        {"kind": "latency", "test": "mixed", "allocator": "gmlake", "ns_per_pair": 5000.0,
         "ops_pairs": 1000, "calls_timed.map": 50, "calls_timed.set_access": 10,
         "calls_timed.pages_stitched": 50},
    ]
    p = tmp_path / "l.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cost_check.main([str(p)])
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mixed")]
    assert len(out) == 1
    cols = out[0].split()
    table = cost_check.costs()
    idle = (50 * table["MAP"][0] + 10 * table["SET_ACCESS"][0]) / 1000
    assert cols[3] == "60", "stitching counters are not calls"
    assert abs(float(cols[4]) - 4.0) < 0.01, "lost: 4,000 ns a pair over 1,000 pairs"
    assert abs(float(cols[5]) - idle) < 0.01
