"""DDP training of a small transformer: `podsim run --topology 2x2x2 -- python ddp.py`, or the
same script under `torchrun --nproc_per_node 8` (gloo)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common

args = common.args(
    lambda p: p.add_argument(
        "--seq-after", default=None, help="STEP:SEQ: batches of SEQ tokens from STEP on"
    )
)
seq_after = tuple(int(x) for x in args.seq_after.split(":")) if args.seq_after else None
dist.init_process_group(common.backend())
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(common.TinyTransformer())
steps_per_s = common.train(model, args.steps, rank, seq_after)
if rank == 0:
    print(f"{steps_per_s:.2f} steps/s")
common.save(dict(model.module.named_parameters()), args.out)
dist.destroy_process_group()
