"""NCCL collectives on stitched tensors, one process a GPU (torchrun, gmlake in every rank).

    torchrun --nproc-per-node 2 -m gmlake dist_collectives.py <out dir>

Every rank builds stitched tensors (checked in gmlake's statistics and snapshot), runs
all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast and send/recv on them,
checks every result against values computed on the CPU, and writes <out>/coll-rank<r>.json.
"""

import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gmlake  # noqa: E402

OUT = sys.argv[1]
MiB = 1 << 20
rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
torch.cuda.set_device(local)
device = torch.device("cuda", local)
dist.init_process_group("nccl", device_id=device)
assert gmlake.is_enabled() and torch.cuda.get_allocator_backend() == "gmlake"


def stitched(numel, dtype=torch.float32):
    s0 = gmlake.stats(device)["gmlake.stitches"]
    tmp = [torch.empty(8 * MiB, dtype=torch.uint8, device=device) for _ in range(24)]
    keep = tmp[1::2]
    del tmp
    t = torch.empty(numel, dtype=dtype, device=device)
    s1 = gmlake.stats(device)["gmlake.stitches"]
    snap = gmlake.snapshot(device)
    ptr = t.data_ptr()
    in_stitched = any(sg["stitched"] and sg["address"] <= ptr < sg["address"] + sg["total_size"]
                      for sg in snap["segments"])
    return t, keep, (s1 > s0) and in_stitched


checks, keep = {}, []
n = (40 * MiB) // 4 + 333  # floats: 40 MiB and a bit, several pages, not a page multiple

x, k, st_x = stitched(n); keep += k
x.copy_(torch.arange(n, dtype=torch.float32, device=device) % 1000 + rank)
dist.all_reduce(x)
want = (torch.arange(n, dtype=torch.float32) % 1000) * world + sum(range(world))
checks["all_reduce"] = bool(torch.equal(x.cpu(), want))

out, k, st_out = stitched(n * world); keep += k
inp = torch.full((n,), float(rank + 1), device=device)
dist.all_gather_into_tensor(out, inp)
want = torch.cat([torch.full((n,), float(r + 1)) for r in range(world)])
checks["all_gather_into_tensor"] = bool(torch.equal(out.cpu(), want))

big, k, st_big = stitched(n * world); keep += k
big.copy_(torch.arange(n * world, dtype=torch.float32, device=device) % 7 + rank)
part = torch.empty(n, device=device)
dist.reduce_scatter_tensor(part, big)
full = (torch.arange(n * world, dtype=torch.float32) % 7) * world + sum(range(world))
checks["reduce_scatter_tensor"] = bool(torch.equal(part.cpu(), full[rank * n:(rank + 1) * n]))

b, k, st_b = stitched(n); keep += k
b.fill_(float(rank * 10 + 5))
dist.broadcast(b, src=0)
checks["broadcast"] = bool(torch.equal(b.cpu(), torch.full((n,), 5.0)))

if world >= 2 and rank < 2:
    peer = 1 - rank
    msg, k, st_msg = stitched(n); keep += k
    if rank == 0:
        msg.copy_(torch.arange(n, dtype=torch.float32, device=device) * 0.5)
        dist.send(msg, dst=peer)
        checks["send_recv"] = True
    else:
        msg.zero_()
        dist.recv(msg, src=peer)
        checks["send_recv"] = bool(torch.equal(msg.cpu(), torch.arange(n, dtype=torch.float32) * 0.5))

torch.cuda.synchronize()
dist.barrier()
stitched_all = all([st_x, st_out, st_big, st_b])
res = dict(rank=rank, world=world, checks=checks, stitched=stitched_all,
           stitches=gmlake.stats(device)["gmlake.stitches"],
           nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, f"coll-rank{rank}.json"), "w") as f:
    json.dump(res, f)
print(f"rank {rank}: {checks} stitched={stitched_all}", flush=True)
dist.destroy_process_group()
