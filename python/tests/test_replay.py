"""Replayed steps (`podsim._replay`) around an optimizer's step, driven by hand in this
process: no podsim binary, no process group."""

import unittest

import torch
from torch.overrides import _get_current_function_mode

from podsim._compute import Compute
from podsim._replay import COUNTED, PARTIAL, REPLAYED, Steps


class OptimizerStepAside(unittest.TestCase):
    def setUp(self):
        # strict: every op its own kernel, so alike steps count alike (fused chains close when
        # Python frees a storage, which moves between steps of so small a model)
        self.compute = Compute("strict")
        self.compute.__enter__()  # a rank starts counting
        self.steps = Steps(self.compute)
        self.model = torch.nn.Linear(4, 4)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def tearDown(self):
        self.steps._step_back()
        if _get_current_function_mode() is self.steps.mode:
            self.steps.mode.__exit__(None, None, None)
        if self.steps.counting:
            self.compute.__exit__(None, None, None)

    def step(self, request=None, closure=False):
        """One training step; `request`: a request the optimizer makes inside its step;
        `closure`: whether the optimizer is given one. Returns (the function mode while the
        optimizer stepped, what the step was)."""
        self.model(torch.ones(2, 4)).sum().backward()
        self.steps.optimizer_step_begins(closure)
        inside = _get_current_function_mode()
        if request is not None:
            self.steps.take(request)
        self.opt.step()
        self.steps.optimizer_step_ends()
        self.opt.zero_grad()
        _, _, kind = self.steps.end_step(("step",), {"peak_bytes": 0})
        return inside, kind

    def test_a_replayed_optimizer_step_runs_without_the_mode(self):
        runs = [self.step() for _ in range(5)]
        # The first step makes the momentum buffers: the second and third agree.
        self.assertEqual([kind for _, kind in runs], [COUNTED] * 3 + [REPLAYED] * 2)
        mode = self.steps.mode
        self.assertEqual([inside is mode for inside, _ in runs], [True] * 3 + [False] * 2)
        # Back on the stack after each; the calls after it (`zero_grad`'s) matched the
        # recording's call by call, or the steps would not have gone on replaying.
        self.assertIs(_get_current_function_mode(), mode)

    def test_a_step_given_a_closure_keeps_the_mode(self):
        runs = [self.step(closure=True) for _ in range(5)]
        self.assertEqual([kind for _, kind in runs], [COUNTED] * 3 + [REPLAYED] * 2)
        self.assertTrue(all(inside is self.steps.mode for inside, _ in runs))

    def test_a_request_that_differs_inside_it_ends_replaying(self):
        for _ in range(3):
            self.step(request=("all_reduce", 16))
        inside, kind = self.step(request=("all_reduce", 32))
        self.assertIsNot(inside, self.steps.mode)  # aside when the step began
        self.assertEqual(kind, PARTIAL)  # its calls before the request were not seen
        self.assertIs(_get_current_function_mode(), self.steps.mode)
        self.assertTrue(self.steps.counting)


if __name__ == "__main__":
    unittest.main()
