"""HBM's saved activations apart from transients (`podsim._saved`): what autograd keeps for
backward, in plain autograd, under `torch.utils.checkpoint`, and beside `torch.func`."""

import unittest

import torch
from torch.utils.checkpoint import checkpoint

from podsim import _saved
from podsim._compute import Compute, Memory

MIB = 1 << 20


class SavedActivations(unittest.TestCase):
    def setUp(self):
        self.compute = Compute("strict")
        self.memory = Memory("cpu", 0, "test chip")
        self.compute.memory = self.memory
        _saved.install(self.compute)
        self.w = torch.nn.Linear(256, 256)
        self.x = torch.randn(1024, 256, requires_grad=True)  # 1 MiB, made before counting

    def kinds(self):
        return {k: round(v / MIB, 2) for k, v in self.memory.by_kind.items()}

    def test_what_backward_reads_is_saved_and_the_rest_transient(self):
        with self.compute:
            h = self.x * 2        # a scalar product saves nothing: a transient the program holds
            r = torch.relu(h)     # relu saves its result for backward
            s = torch.sin(r)      # sin saves its input (r, saved already); s is a transient
            kinds = self.kinds()
        self.assertEqual((kinds["saved activations"], kinds["transients"]), (1.0, 2.0))
        s.sum().backward()

    def test_a_checkpointed_block_saves_its_input_then_what_it_recomputes(self):
        block = lambda t: self.w(torch.relu(self.w(t)))  # noqa: E731
        with self.compute:
            h = self.x * 2  # 1 MiB, the checkpointed block's input
            out = checkpoint(block, h, use_reentrant=False)
            self.assertEqual(self.kinds()["saved activations"], 1.0)
            peak_before = self.memory.peak_by_kind["saved activations"]
            out.sum().backward()
        # In backward the recomputed relu output (and the inner linear's input) were held.
        self.assertGreater(self.memory.peak_by_kind["saved activations"], peak_before)

    def test_torch_func_runs_beside_the_hooks(self):
        g = torch.func.grad(lambda a: (a.sin() * a).sum())(torch.ones(3))
        self.assertTrue(torch.allclose(g, torch.ones(3).cos() * 1 + torch.ones(3).sin()))
        self.assertEqual(torch._C._autograd._top_saved_tensors_default_hooks(True),
                         (_saved._pack, _saved._unpack))


if __name__ == "__main__":
    unittest.main()
