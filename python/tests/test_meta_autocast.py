"""Autocast on meta tensors (`podsim._meta_autocast`): the dtypes CUDA's autocast gives, which
torch's own autocast does not give meta tensors. No podsim binary, no process group."""

import unittest

import torch
import torch.nn.functional as F

from podsim import _meta_autocast

_meta_autocast.install()


def under_autocast(fn):
    """`fn()` with podsim's meta-mode casts, in an autocast region of bfloat16."""

    class Casting(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            args, kwargs = _meta_autocast.casts(func, args, kwargs or {})
            return func(*args, **kwargs)

    with Casting(), torch.autocast("cpu", dtype=torch.bfloat16):
        return fn()


class MetaAutocast(unittest.TestCase):
    def setUp(self):
        self.layer = torch.nn.Linear(64, 32, device="meta")
        self.x = torch.empty(8, 64, device="meta")

    def test_torch_alone_leaves_meta_tensors_in_float32(self):
        # What this module is for: without it, autocast does nothing to meta tensors.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            self.assertEqual(self.layer(self.x).dtype, torch.float32)

    def test_products_run_in_the_low_precision_and_softmax_in_float32(self):
        def program():
            h = self.layer(self.x)
            scores = h @ h.T
            return h, scores, F.softmax(scores, dim=-1), torch.exp(scores)

        h, scores, p, e = under_autocast(program)
        self.assertEqual((h.dtype, scores.dtype), (torch.bfloat16, torch.bfloat16))
        self.assertEqual((p.dtype, e.dtype), (torch.float32, torch.float32))

    def test_an_explicit_dtype_is_kept(self):
        out = under_autocast(lambda: torch.sum(self.layer(self.x), dim=0, dtype=torch.bfloat16))
        self.assertEqual(out.dtype, torch.bfloat16)

    def test_a_parameter_is_cast_once_per_region(self):
        w = self.layer.weight
        seen = []

        def program():
            F.linear(self.x, w)
            seen.append(_meta_autocast._cache[id(w)][1])
            F.linear(self.x, w)
            seen.append(_meta_autocast._cache[id(w)][1])

        under_autocast(program)
        self.assertIsNone(_meta_autocast._cache.get(id(w)))  # dropped when the region ended
        self.assertIs(seen[0], seen[1])
        self.assertEqual(seen[0].dtype, torch.bfloat16)

    def test_outside_a_region_nothing_is_cast(self):
        class Casting(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                args, kwargs = _meta_autocast.casts(func, args, kwargs or {})
                return func(*args, **kwargs)

        with Casting():
            self.assertEqual(self.layer(self.x).dtype, torch.float32)

    def test_autograd_gives_gradients_in_the_parameters_dtype(self):
        x = torch.randn(4, 64)
        layer = torch.nn.Linear(64, 32)
        under_autocast(lambda: layer(x).float().sum()).backward()
        self.assertEqual(layer.weight.grad.dtype, torch.float32)


if __name__ == "__main__":
    unittest.main()
