"""Meta mode's stand-in for DDP's C++ reducer (`podsim._meta_ddp`) against the reducer itself.

Both run here on real CPU tensors, in a process group of one rank (gloo), so that what the
stand-in does can be compared with torch's own DDP: the buckets it makes (their sizes, at
the first step and after they are rebuilt in the order gradients became ready) and the
gradients it leaves (bit for bit), under DDP's options - bucket caps, unused parameters,
gradients as bucket views, static graphs, comm hooks. No podsim binary is needed."""

import os
import random
import unittest

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from podsim import _meta_ddp

PATCHED = ("Reducer", "Logger", "_broadcast_coalesced", "_register_comm_hook",
           "_register_builtin_comm_hook")


class Branchy(torch.nn.Module):
    """Layers of the given widths, and one layer the forward uses only when asked."""

    def __init__(self, widths):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.spare = torch.nn.Linear(widths[-1], widths[-1])
        self.use_spare = True

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.spare(x) if self.use_spare else x


def train(stand_in, widths, steps=3, unused_from=None, hook=None, **ddp_options):
    """Trains with DDP (the stand-in or torch's reducer); the bucket sizes after each step and
    the final gradients."""
    import torch.nn.parallel.distributed as ddp_module

    saved = {name: getattr(dist, name) for name in PATCHED}
    saved_verify = ddp_module._verify_param_shape_across_processes
    if stand_in:
        _meta_ddp.install()
    try:
        torch.manual_seed(0)
        model = Branchy(widths)
        ddp = DDP(model, **ddp_options)
        assert isinstance(ddp.reducer, _meta_ddp.Reducer) == stand_in
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        sizes = []
        for step in range(steps):
            model.use_spare = unused_from is None or step < unused_from
            x = torch.randn(4, widths[0], generator=torch.Generator().manual_seed(step))
            ddp(x).square().mean().backward()
            sizes.append(bucket_sizes(ddp.reducer))
            grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return sizes, grads
    finally:
        for name, value in saved.items():
            setattr(dist, name, value)
        ddp_module._verify_param_shape_across_processes = saved_verify


def bucket_sizes(reducer):
    if isinstance(reducer, _meta_ddp.Reducer):
        return [b.flat.numel() for b in reducer.buckets]
    return [b.buffer().numel() for b in reducer._get_zeros_like_grad_buckets()]


class StandInReducerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()

    def same_as_torch(self, widths, **options):
        theirs = train(False, widths, **options)
        ours = train(True, widths, **options)
        self.assertEqual(ours[0], theirs[0], "bucket sizes by step")
        for mine, real in zip(ours[1], theirs[1]):
            if real is None:
                self.assertIsNone(mine)
            else:
                self.assertTrue(torch.equal(mine, real), "gradients")

    def test_default_buckets_rebuilt_after_the_first_step(self):
        self.same_as_torch([64, 512, 512, 256, 8])

    def test_small_bucket_caps(self):
        self.same_as_torch([32, 256, 256, 256, 128, 8], bucket_cap_mb=0.5)

    def test_random_widths_and_caps(self):
        rng = random.Random(7)
        for _ in range(4):
            widths = [rng.choice([8, 48, 200, 384, 700]) for _ in range(rng.randint(2, 6))]
            with self.subTest(widths=widths):
                self.same_as_torch(widths, bucket_cap_mb=rng.choice([0.25, 1, 25]))

    def test_unused_parameters(self):
        self.same_as_torch([32, 256, 64], find_unused_parameters=True, unused_from=1)

    def test_gradients_as_bucket_views(self):
        self.same_as_torch([32, 256, 256, 8], gradient_as_bucket_view=True, bucket_cap_mb=0.25)

    def test_static_graph(self):
        self.same_as_torch([32, 256, 256, 8], static_graph=True, bucket_cap_mb=0.25)

    def test_comm_hook(self):
        self.same_as_torch([32, 256, 256, 8], bucket_cap_mb=0.25,
                           hook=default_hooks.fp16_compress_hook)


if __name__ == "__main__":
    unittest.main()
