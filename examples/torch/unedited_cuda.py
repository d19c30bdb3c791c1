"""A DDP program written for GPUs, as its authors run it under torchrun with NCCL: `nccl`,
`torch.cuda.set_device`, `.cuda()`, `device="cuda"`, `device_ids`. It knows nothing of podsim;
`podsim run` runs it as it is (on this CPU-only host torchrun cannot)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--hidden", type=int, default=32, help="width of the hidden layers")
args = parser.parse_args()

dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
h = args.hidden
model = nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 4)).cuda()
ddp = nn.parallel.DistributedDataParallel(model, device_ids=[int(os.environ["LOCAL_RANK"])])
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    x = torch.randn(8, 16, generator=generator).to("cuda", non_blocking=True)
    loss = ddp(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.6f}", flush=True)
dist.destroy_process_group()
