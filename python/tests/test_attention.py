"""Attention priced as the chip's flash kernel (`podsim._compute.price_attention_as_flash`):
SDPA and flex attention give torch's own values and gradients on real tensors, shapes on meta
tensors, and count one kernel forward and one backward. No podsim binary, no process group."""

import unittest

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as fa

from podsim._compute import Compute, price_attention_as_flash

B, H, L, D = 2, 4, 128, 16

# Installed once for the module: it replaces torch's functions in this process.
COMPUTE = Compute("strict")
SDPA, FLEX = F.scaled_dot_product_attention, fa.flex_attention
price_attention_as_flash(COMPUTE)


def inputs(device="cpu", kv_heads=H):
    generator = torch.Generator().manual_seed(3)
    shapes = ((B, H, L, D), (B, kv_heads, L, D), (B, kv_heads, L, D))
    made = [torch.randn(s, generator=generator).to(device) for s in shapes]
    return [x.requires_grad_(True) for x in made]


def attention_counted():
    """The attention kernels counted since the last call: {(causal, backward): calls}."""
    out = {}
    for batch, seq, heads, head_dim, causal, backward, elem, calls in COMPUTE.take()["attention"]:
        self_check = (batch, seq, heads, head_dim, elem) == (B, L, H, D, 4)
        assert self_check, (batch, seq, heads, head_dim, elem)
        out[(causal, backward)] = out.get((causal, backward), 0) + calls
    return out


class PricedAttention(unittest.TestCase):
    def setUp(self):
        COMPUTE.take()

    def check_same_as_torch(self, priced, original):
        mine, theirs = inputs(), inputs()
        with COMPUTE:
            out = priced(*mine)
            out.sum().backward()
        want = original(*theirs)
        want.sum().backward()
        torch.testing.assert_close(out, want)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a.grad, b.grad)

    def test_sdpa_gives_torchs_values_and_counts_one_kernel_each_way(self):
        self.check_same_as_torch(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), lambda q, k, v: SDPA(q, k, v, is_causal=True))
        self.assertEqual(attention_counted(), {(1, 0): 1, (1, 1): 1})

    def test_flex_attention_gives_torchs_values_and_counts_one_kernel(self):
        mine, theirs = inputs(), [x.detach() for x in inputs()]
        with COMPUTE:
            out = fa.flex_attention(*mine)
        torch.testing.assert_close(out, FLEX(*theirs))
        self.assertEqual(attention_counted(), {(0, 0): 1})
        # torch has no flex attention backward on the CPU: data mode fails as torchrun would.
        with self.assertRaisesRegex(NotImplementedError, "backward on CPU"):
            with COMPUTE:
                out.sum().backward()

    def test_a_block_mask_is_priced_as_causal(self):
        def causal(b, h, q, kv):
            return q >= kv

        mask = fa.create_block_mask(causal, None, None, L, L, device="cpu")
        q, k, v = [x.detach() for x in inputs()]
        with COMPUTE:
            out = fa.flex_attention(q, k, v, block_mask=mask)
        torch.testing.assert_close(out, FLEX(q, k, v, block_mask=mask))
        torch.testing.assert_close(out, SDPA(q, k, v, is_causal=True))
        self.assertEqual(attention_counted(), {(1, 0): 1})

    def test_flex_attention_on_meta_tensors_is_shapes_and_its_lse_on_request(self):
        q, k, v = inputs("meta", kv_heads=2)
        with COMPUTE:
            out, aux = fa.flex_attention(q, k, v, enable_gqa=True,
                                         return_aux=fa.AuxRequest(lse=True))
            out.sum().backward()
        self.assertEqual((out.device.type, tuple(out.shape)), ("meta", (B, H, L, D)))
        self.assertEqual(tuple(aux.lse.shape), (B, H, L))
        self.assertEqual(aux.lse.dtype, torch.float32)
        self.assertEqual([tuple(x.grad.shape) for x in (q, k, v)],
                         [(B, H, L, D), (B, 2, L, D), (B, 2, L, D)])
        self.assertEqual(attention_counted(), {(0, 0): 1, (0, 1): 1})


if __name__ == "__main__":
    unittest.main()
