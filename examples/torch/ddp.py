"""DDP training of a small transformer: `podsim run --topology 2x2x2 -- python ddp.py`, or the
same script under `torchrun --nproc_per_node 8` (gloo)."""

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common

args = common.args()
dist.init_process_group(common.backend())
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(common.TinyTransformer())
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
start = time.perf_counter()
for step in range(args.steps):
    inputs, targets = common.batch(step, rank)
    loss = common.loss_of(model, inputs, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    common.mark_step()
    if rank == 0 and step % 5 == 0:
        print(f"step {step} loss {loss.item():.4f}")
wall = time.perf_counter() - start
if rank == 0:
    print(f"{args.steps / wall:.2f} steps/s")
common.save(dict(model.module.named_parameters()), args.out)
dist.destroy_process_group()
