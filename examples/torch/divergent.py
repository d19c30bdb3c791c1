"""llama.py with the kind of bug podsim is for: one rank skips a backward.

`--skip-rank R --skip-step S`: rank R does not run the backward of step S (a data-dependent
branch taken on one rank only, as a loss spike check or a bad batch filter would). Every other
rank waits in that backward's collectives forever; under podsim the representative's shadows
find it at once:

    podsim run --mode meta --topology 16x16x16 --verify-ranks 1234 -- \\
        python divergent.py --skip-rank 1234 --skip-step 2
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from llama import MODELS, Transformer

parser = argparse.ArgumentParser()
parser.add_argument("--skip-rank", type=int, default=1)
parser.add_argument("--skip-step", type=int, default=2)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = "cuda" if torch.cuda.is_available() else "cpu"
mesh = init_device_mesh(device, (world,))
margs = MODELS["debug"]
with torch.device("meta"):
    model = Transformer(margs)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.layers:
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
model.to_empty(device=device)
with torch.no_grad():
    model.init_weights()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, args.steps + 1):
    tokens = torch.randint(0, margs.vocab, (2, 65)).to(device)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    if not (rank == args.skip_rank and step == args.skip_step):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
