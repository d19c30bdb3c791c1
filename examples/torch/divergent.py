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

from llama import MODELS, setup, sharded_model

parser = argparse.ArgumentParser()
parser.add_argument("--skip-rank", type=int, default=1)
parser.add_argument("--skip-step", type=int, default=2)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

device, mesh = setup()
rank = dist.get_rank()
margs = MODELS["debug"]
model = sharded_model(margs, mesh, device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, args.steps + 1):
    tokens = torch.randint(0, margs.vocab, (2, 65)).to(device)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    if not (rank == args.skip_rank and step == args.skip_step):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
