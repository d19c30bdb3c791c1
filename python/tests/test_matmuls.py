"""Matrix products priced by their shapes, checked against the closed form `2 m k n` per
product, on meta tensors (shapes only). No podsim binary, no process group."""

import unittest

import torch

from podsim._compute import Compute


def flops(taken):
    return sum(2 * m * k * n * calls for m, k, n, calls, _ in taken["matmuls"])


def counted(fn):
    compute = Compute("strict")
    with compute:
        fn()
    return compute.take()


@unittest.skipUnless(hasattr(torch, "_grouped_mm"), "this torch has no grouped matmul")
class GroupedMatmuls(unittest.TestCase):
    """A mixture of experts' experts: `tokens` rows routed to `experts` weight matrices."""

    tokens, d_in, d_out, experts = 4096, 256, 512, 8

    def operands(self):
        meta = dict(device="meta", dtype=torch.bfloat16)
        x = torch.empty(self.tokens, self.d_in, requires_grad=True, **meta)
        # `_grouped_mm` wants its second factor column-major, as a model stores `w.T`.
        w = torch.empty(self.experts, self.d_out, self.d_in, requires_grad=True, **meta)
        offs = torch.empty(self.experts, dtype=torch.int32, device="meta")
        return x, w.transpose(-2, -1), offs

    def test_forward_is_the_work_of_every_token_through_one_expert(self):
        x, w, offs = self.operands()
        taken = counted(lambda: torch._grouped_mm(x, w, offs=offs))
        self.assertEqual(flops(taken), 2 * self.tokens * self.d_in * self.d_out)
        self.assertEqual(taken["kernels"], 0)  # not priced as a pass over memory

    def test_backward_is_twice_the_forward(self):
        x, w, offs = self.operands()
        out = torch._grouped_mm(x, w, offs=offs)
        taken = counted(lambda: out.backward(torch.empty_like(out)))
        self.assertEqual(flops(taken), 2 * 2 * self.tokens * self.d_in * self.d_out)

    def test_ordinary_products_keep_their_closed_form(self):
        a = torch.empty(64, 32, device="meta")
        b = torch.empty(32, 16, device="meta")
        bias = torch.empty(16, device="meta")
        taken = counted(lambda: (a @ b, torch.addmm(bias, a, b), torch.bmm(a[None], b[None])))
        self.assertEqual(flops(taken), 3 * 2 * 64 * 32 * 16)


if __name__ == "__main__":
    unittest.main()
