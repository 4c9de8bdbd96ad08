"""A short LoRA training loop (gradient checkpointing, varying sequence lengths) under the
native allocator, expandable segments and gmlake, in one run: same losses, and the memory
utilization and median step time of each."""

import math

from harness import CASES, run_python, write_out


def test_training_losses_match_native_and_report():
    runs = {}
    for allocator in ("native", "expandable", "gmlake"):
        r = run_python(f"train_{allocator}", script=CASES / "train_lora.py", allocator=allocator, timeout=240)
        runs[allocator] = r.result
        assert runs[allocator].get("losses"), r.tail()
    native, gm = runs["native"], runs["gmlake"]
    assert native["impl"] == gm["impl"]
    diffs = [abs(a - b) / max(1e-6, abs(a)) for a, b in zip(native["losses"], gm["losses"])]
    identical = sum(a == b for a, b in zip(native["losses"], gm["losses"]))
    table = []
    for name, res in runs.items():
        table.append(
            f"{name:>11}: median step {res['median_step_s'] * 1000:8.2f} ms  "
            f"peak allocated {res['peak_allocated'] / 2**30:7.3f} GiB  "
            f"peak reserved {res['peak_reserved'] / 2**30:7.3f} GiB  "
            f"utilization {res['utilization']:.3f}"
            + (f"  stitches {res['gmlake.stitches']}" if "gmlake.stitches" in res else "")
        )
    summary = {
        "model": gm["impl"],
        "steps": len(gm["losses"]),
        "identical_losses": identical,
        "max_rel_loss_diff_vs_native": max(diffs),
        "runs": runs,
        "table": table,
    }
    write_out("training.json", summary)
    print("\n".join(table))
    print(f"losses identical to native: {identical}/{len(diffs)}; max relative difference {max(diffs):.3g}")
    assert len(native["losses"]) == len(gm["losses"])
    assert all(math.isfinite(x) for x in gm["losses"])
    assert max(diffs) < 1e-3, f"gmlake's losses differ from native's: {list(zip(native['losses'], gm['losses']))}"
