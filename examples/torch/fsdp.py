"""FSDP2 (`fully_shard`) training of a small transformer: every block sharded over all ranks,
then the root. `podsim run --topology 2x2x2 -- python fsdp.py`, or under torchrun (gloo)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import common

args = common.args()
dist.init_process_group(common.backend())
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = common.TinyTransformer()
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
common.train(model, args.steps, rank)
full = {name: p.full_tensor() for name, p in model.named_parameters()}
common.save(full, args.out)
dist.destroy_process_group()
