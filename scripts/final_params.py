"""Runs a program unedited and saves, as it ends, every parameter its optimizers stepped.

    python final_params.py OUT script.py args...

Each rank writes `OUT.rank<RANK>`: a dict of the parameters of every optimizer that took a
step, in the order the optimizers first stepped (`opt<i>.group<j>.param<k>`), each as this
rank holds it (a DTensor's local shard), copied to the CPU. torch's global generator is
seeded with 0 first: the public programs `public_programs.py` runs draw their data and weights
without a seed, so two runs of them would otherwise never agree.

Nothing in the program is changed: the parameters are found through torch's global
optimizer-step hook, so a program that builds its model inside a function is covered too.
"""

import atexit
import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def main():
    out, script, *script_args = sys.argv[1:]
    stepped = []

    def remember(optimizer, _args, _kwargs):
        if not any(o is optimizer for o in stepped):
            stepped.append(optimizer)

    register_optimizer_step_post_hook(remember)
    # atexit, not after run_path: programs end with sys.exit() or exit() too.
    atexit.register(save, stepped, f"{out}.rank{os.environ.get('RANK', '0')}")
    torch.manual_seed(0)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def save(optimizers, path):
    tensors = {}
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for k, p in enumerate(group["params"]):
                local = p.to_local() if hasattr(p, "to_local") else p
                tensors[f"opt{i}.group{j}.param{k}"] = local.detach().to("cpu").clone()
    torch.save(tensors, path)


if __name__ == "__main__":
    main()
