"""DTensor on a 2x4 device mesh: redistributions between Shard(0), Shard(1), Replicate and
Partial, then a tensor-parallel MLP (`parallelize_module`, colwise then rowwise) trained for a
few steps. `podsim run --topology 4x2 -- python dtensor.py` (mesh rows are the x rings), or
under `torchrun --nproc_per_node 8` (gloo). Saves every result for comparison."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import common

args = common.args()
dist.init_process_group(common.backend())
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
out = {}

# Redistributions: every pair of 2-D placements drawn from these.
placements = [
    (Shard(0), Shard(1)),
    (Shard(1), Shard(0)),
    (Replicate(), Shard(0)),
    (Shard(0), Replicate()),
    (Replicate(), Replicate()),
    (Partial(), Shard(1)),
    (Replicate(), Partial()),
]
torch.manual_seed(0)
x = torch.randn(8, 12)
for i, src in enumerate(placements):
    for j, dst in enumerate(placements):
        if any(isinstance(p, Partial) for p in dst):
            continue  # a redistribution never creates a pending sum
        if any(isinstance(p, Partial) for p in src):
            # A Partial source: each rank holds its share of the sum.
            local = distribute_tensor(x, mesh, [Replicate() if isinstance(p, Partial) else p for p in src])
            n = 1
            for d, p in enumerate(src):
                if isinstance(p, Partial):
                    n *= mesh.size(d)
            d = DTensor.from_local(local.to_local() / n, mesh, src)
        else:
            d = distribute_tensor(x, mesh, src)
        moved = d.redistribute(mesh, dst)
        out[f"redistribute/{i}->{j}"] = moved.full_tensor()
        out[f"local/{i}->{j}/rank{rank}"] = moved.to_local()

# Tensor parallelism: fc1 colwise, fc2 rowwise, over the 4-way dimension.
torch.manual_seed(1)
mlp = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 12))
parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
for step in range(args.steps):
    g = torch.Generator().manual_seed(step)  # the same batch on every rank: TP only
    inputs, targets = torch.randn(6, 12, generator=g), torch.randn(6, 12, generator=g)
    loss = ((mlp(inputs) - targets) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    common.mark_step()
for name, p in mlp.named_parameters():
    out[f"mlp/{name}"] = p.full_tensor()

locals_only = {k: v for k, v in out.items() if k.startswith("local/")}
common.save({k: v for k, v in out.items() if not k.startswith("local/")}, args.out)
if args.out:
    torch.save(locals_only, f"{args.out}.rank{rank}")
dist.destroy_process_group()
