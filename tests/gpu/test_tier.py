"""The host tier (issue 16) on the GPU: put/get round trips of data under a tiny budget,
ownership rules, and gmlake.tier.offload_activations on a small training job (same losses as
without it; lower peak reserved under a budget)."""

from harness import run_python, write_out

ROUND_TRIP = r"""
import gmlake.tier as tier
torch.manual_seed(0)
tier.configure(budget_bytes=16 * MiB, policy="lru")
keep, handles = [], []
for i in range(12):
    t = torch.randn(2 * MiB, device="cuda")  # 8 MiB
    keep.append(t.cpu())
    handles.append(tier.put(t, next_use=i))
    del t
torch.cuda.synchronize()
tier.flush()
states = [tier.state(h) for h in handles]
s = tier.stats()
assert s["evictions"] >= 10, s
assert s["device_bytes"] <= 16 * MiB, s
assert states.count("evicted") >= 10, states
# Back in reverse order, each equal to what was put (possibly at another address).
for i in reversed(range(12)):
    g = tier.get(handles[i])
    assert g.dtype == torch.float32 and g.shape == (2 * MiB,), (g.dtype, g.shape)
    assert torch.equal(g.cpu(), keep[i]), i
    del g
    tier.free(handles[i])
tier.verify()
s2 = tier.stats()
assert s2["tensors"] == 0 and s2["handles"] == 0, s2

# Views: shape, strides and storage offset survive; the tensor stays valid while alive.
base = torch.arange(64 * 1024, dtype=torch.float64, device="cuda").reshape(256, 256)
view = base[3:, 1::2]
want = view.cpu()                      # contiguous on the host: compare strides with the view's
want_stride = view.stride()
h = tier.put(view, next_use=1)
assert tier.state(h) == "resident", "a live tensor stays on the device"
assert torch.equal(base[3:, 1::2].cpu(), want)
del base, view
big = [tier.put(torch.ones(4 * MiB, device="cuda")) for _ in range(6)]  # 16 MiB each: evicts
torch.cuda.synchronize(); tier.flush()
assert tier.state(h) in ("evicted", "evicting"), tier.state(h)
g = tier.get(h)
assert g.shape == want.shape and g.stride() == want_stride and g.storage_offset() == 3 * 256 + 1, \
    (g.shape, g.stride(), g.storage_offset())
assert torch.equal(g.cpu(), want)
g2 = tier.get(h)  # a second get while the first lives: same memory
assert g2.data_ptr() == g.data_ptr()
del g, g2
tier.free(h)
for b in big:
    tier.free(b)
tier.verify()

# Errors name the problem.
try:
    tier.free(h)
    raise SystemExit("free twice accepted")
except ValueError as e:
    assert "unknown handle" in str(e)
try:
    tier.put(torch.ones(3))
    raise SystemExit("CPU tensor accepted")
except ValueError as e:
    assert "CUDA" in str(e)
tier.flush(trim=True)
result(stats=tier.stats(), states=states)
"""


def test_put_get_round_trip_under_a_tiny_budget():
    r = run_python("tier_round_trip", ROUND_TRIP, timeout=180)
    write_out("tier_round_trip.json", r.result)


TRAIN = r"""
import gmlake.tier as tier
mode = os.environ["TIER_MODE"]
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
width, depth, rows = 2048, 12, 8192
layers = []
for _ in range(depth):
    layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
gen = torch.Generator(device="cuda").manual_seed(1)
cap = int(os.environ.get("TIER_CAP", "0"))
if cap:
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
if mode == "tier":
    tier.configure(budget_bytes=256 * MiB, policy=os.environ.get("TIER_POLICY", "aware"),
                   host_cache_bytes=4 * GiB)
losses, peaks = [], []
for step in range(6):
    x = torch.randn(rows, width, device="cuda", generator=gen)
    y = torch.randn(rows, 1, device="cuda", generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if mode == "tier":
        with tier.offload_activations(min_bytes=1 * MiB):
            loss = torch.nn.functional.mse_loss(model(x), y)
    else:
        loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    losses.append(loss.item())
    peaks.append(torch.cuda.max_memory_reserved())
    del loss, x, y
out = dict(losses=losses, peak_reserved=max(peaks[1:]))
if mode == "tier":
    tier.flush()
    s = tier.stats()
    tier.verify()
    out["tier"] = s
    assert s["handles"] == 0, s
result(**out)
"""


def test_offload_activations_same_losses_lower_peak():
    """Without the tier the job's peak reserved is P; with it (budget 256 MiB) the job runs
    under a cap of 0.6 P (evictions free blocks once their copies complete; an allocation over
    the cap first makes the tier evict and wait), with the same losses."""
    runs = {}
    plain = run_python("tier_train_plain", TRAIN, env={"TIER_MODE": "plain"}, timeout=240).result
    runs["plain"] = plain
    cap = int(plain["peak_reserved"] * 0.6)
    for policy in ("aware", "lru"):
        env = {"TIER_MODE": "tier", "TIER_POLICY": policy, "TIER_CAP": str(cap)}
        r = run_python(f"tier_train_{policy}", TRAIN, env=env, timeout=240)
        runs[f"tier_{policy}"] = r.result
    runs["cap"] = cap
    write_out("tier_train.json", runs)
    for key in ("tier_aware", "tier_lru"):
        t = runs[key]
        assert len(t["losses"]) == len(plain["losses"])
        for a, b in zip(plain["losses"], t["losses"]):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (key, plain["losses"], t["losses"])
        assert t["tier"]["evictions"] > 0, t["tier"]
        assert t["peak_reserved"] <= cap < plain["peak_reserved"], (key, t["peak_reserved"], cap)
    print(
        {k: (v["peak_reserved"] / 2**20, v.get("tier", {}).get("bytes_to_host"))
         for k, v in runs.items() if isinstance(v, dict)}
    )
