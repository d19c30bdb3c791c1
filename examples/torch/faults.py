"""A training loop that misbehaves on purpose, for podsim's fault tests: rank R, at step S,
sleeps forever (`--fault sleep`), skips one all-reduce (`--fault skip`), dies
(`--fault exit`), raises an exception (`--fault raise`), raises one, prints it and exits 1 as
frameworks that report their own errors do (`--fault handled`), or receives from rank R^1 while that
rank receives from it, the other ranks finishing (`--fault deadlock`). Gradients are all-reduced parameter by parameter, so a skipped call meets a
call of another shape on the other ranks."""

import os
import sys
import time

import torch
import torch.distributed as dist

import common


def extra(p):
    p.add_argument("--fault", choices=["none", "sleep", "skip", "exit", "raise", "handled", "deadlock"], default="none")
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--at", type=int, default=5)


args = common.args(extra)
dist.init_process_group(common.backend())
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = common.TinyTransformer()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(args.steps):
    faulty = rank == args.rank and step == args.at
    if faulty:
        # When the fault happens, for the tests' measure of how fast it is diagnosed.
        print(f"fault {args.fault} at {time.time():.6f}", flush=True)
    if faulty and args.fault == "exit":
        os._exit(1)
    if faulty and args.fault == "raise":
        raise RuntimeError(f"rank {rank} gives up at step {step}")
    if faulty and args.fault == "handled":
        try:
            raise ValueError(f"rank {rank} gives up at step {step}")
        except ValueError as e:
            print(f"Error executing job: {e}", file=sys.stderr)
            sys.exit(1)
    if faulty and args.fault == "sleep":
        time.sleep(3600)  # the line a stalled_chip diagnosis must name
    if args.fault == "deadlock" and step == args.at:
        pair = (args.rank, args.rank ^ 1)
        if rank in pair:
            dist.recv(torch.empty(1), pair[0] + pair[1] - rank)  # both receive first
        break  # the other ranks finish
    inputs, targets = common.batch(step, rank)
    loss = common.loss_of(model, inputs, targets)
    opt.zero_grad()
    loss.backward()
    for i, p in enumerate(model.parameters()):
        if faulty and args.fault == "skip" and i == 0:
            continue  # this rank's program skips one collective
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    common.mark_step()
dist.destroy_process_group()
