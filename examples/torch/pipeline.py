"""Pipeline parallelism written by hand with `send`/`recv`, times data parallelism: the small
transformer cut into 4 stages (one block each), GPipe's schedule (every microbatch forward,
then every microbatch backward), activations and their gradients passed between neighbouring
stages, and each stage's gradients averaged over the pipelines. 8 ranks are 2 pipelines of 4.
`podsim run --topology 2x2x2 -- python pipeline.py`, or `torchrun --nproc_per_node 8`."""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common

STAGES = 4


class Stage(nn.Module):
    """Stage `stage` of `full`: the embeddings before the first block, the head after the last."""

    def __init__(self, full, stage):
        super().__init__()
        self.first, self.last = stage == 0, stage == STAGES - 1
        self.block = full.blocks[stage]
        if self.first:
            self.embed, self.pos = full.embed, full.pos
        if self.last:
            self.norm, self.head = full.norm, full.head

    def forward(self, x):
        if self.first:
            x = self.embed(x) + self.pos[: x.shape[1]]
        x = self.block(x)
        return self.head(self.norm(x)) if self.last else x


args = common.args(lambda p: p.add_argument("--microbatches", type=int, default=2))
dist.init_process_group(common.backend())
rank, world = dist.get_rank(), dist.get_world_size()
stage, pipeline = rank % STAGES, rank // STAGES
pipelines = world // STAGES
torch.manual_seed(0)
full = common.TinyTransformer(layers=STAGES)
model = Stage(full, stage)
# Every rank makes every group (torch's rule); each stage's copies average their gradients.
replicas = [dist.new_group([s + STAGES * p for p in range(pipelines)]) for s in range(STAGES)]
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
micro = args.microbatches
start = time.perf_counter()
for step in range(args.steps):
    opt.zero_grad()
    inputs, outputs = [], []
    for m in range(micro):
        tokens, targets = common.batch(step, pipeline * micro + m, per_rank=2)
        if model.first:
            x = tokens
        else:
            x = torch.empty(2, 16, 32)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = model(x)
        if model.last:
            loss = F.cross_entropy(y.reshape(-1, y.shape[-1]), targets.reshape(-1)) / micro
            outputs.append(loss)
        else:
            dist.send(y.detach(), rank + 1)
            outputs.append(y)
        inputs.append(x)
    for m in reversed(range(micro)):
        if model.last:
            outputs[m].backward()
        else:
            grad = torch.empty_like(outputs[m])
            dist.recv(grad, rank + 1)
            outputs[m].backward(grad)
        if not model.first:
            dist.send(inputs[m].grad, rank - 1)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=replicas[stage])
        p.grad /= pipelines
    opt.step()
    common.mark_step()
    if model.last and pipeline == 0 and step % 5 == 0:
        print(f"step {step} loss {outputs[-1].item() * micro:.4f}")
steps_per_s = args.steps / (time.perf_counter() - start)
if rank == 0:
    print(f"{steps_per_s:.2f} steps/s")
# The whole model on rank 0: each stage's parameters under their names in the full model.
owned = {id(p) for p in model.parameters()}
mine = {k: v.detach().clone() for k, v in full.named_parameters() if id(v) in owned}
every = [None] * world
dist.all_gather_object(every, mine if pipeline == 0 else {})
common.save({k: v for part in every for k, v in part.items()}, args.out)
dist.destroy_process_group()
