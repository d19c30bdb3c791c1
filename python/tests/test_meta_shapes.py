"""Stand-in sizes for ops whose shape is data (`podsim._meta_shapes`), on meta tensors, as meta
mode's function mode applies them. No podsim binary, no process group."""

import unittest

import torch

from podsim import _meta_counts, _meta_shapes

T, E, K, D = 512, 8, 2, 16


class Meta(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _meta_shapes.FUNCTIONS:
            out = _meta_shapes.stand_in(func, args, kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        _meta_counts.carry(func, args, kwargs, out)
        return out


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


class StandInSizes(unittest.TestCase):
    def test_torch_alone_refuses_them(self):
        # What this module is for.
        with self.assertRaises(NotImplementedError):
            meta(4, 8, dtype=torch.bool).nonzero()

    def test_an_unknown_mask_keeps_every_element(self):
        with Meta():
            labels = meta(T, dtype=torch.long)
            loss = meta(T).requires_grad_()
            kept = loss[labels != -100]
            kept.sum().backward()
        self.assertEqual(tuple(kept.shape), (T,))
        self.assertEqual(tuple(loss.grad.shape), (T,))

    def test_the_experts_of_a_one_hot_router_get_every_routed_token(self):
        # Hugging Face's experts loop: one-hot of E + 1 classes, one expert's mask at a time.
        with Meta():
            ids = meta(T, K, dtype=torch.long)
            mask = torch.nn.functional.one_hot(ids, num_classes=E + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            per_expert = [torch.where(mask[e])[1].shape[0] for e in range(E + 1)]
        self.assertEqual(tuple(hit.shape), (E + 1, 1))  # counts of E + 1 experts: all > 0
        # Each expert's share rounds to whole tokens on its own: within one token each.
        self.assertLessEqual(abs(sum(per_expert) - T * K), E + 1)

    def test_masked_select_and_bincount(self):
        with Meta():
            x = meta(T, D)
            picked = torch.masked_select(x, meta(T, 1, dtype=torch.bool))
            counts = torch.bincount(meta(T * K, dtype=torch.long), minlength=E)
        self.assertEqual(tuple(picked.shape), (T * D,))
        self.assertEqual(_meta_counts.balanced(counts).tolist(), [T * K // E] * E)

    def test_real_tensors_run_as_torch_runs_them(self):
        with Meta():
            x = torch.tensor([0, 3, 0, 5])
            self.assertEqual(x.nonzero().view(-1).tolist(), [1, 3])
            self.assertEqual(x[x > 0].tolist(), [3, 5])

    def test_three_argument_where_is_untouched(self):
        with Meta():
            out = torch.where(meta(T, dtype=torch.bool), meta(T), meta(T))
        self.assertEqual(tuple(out.shape), (T,))


if __name__ == "__main__":
    unittest.main()
