"""The reductions a rank does itself over gathered inputs (those podsim's chips do not do), and
the raw-bytes words collectives move for dtypes that are not added: against naive loops."""

import unittest

import torch
import torch.distributed as dist

from podsim.torch import _as_words, _from_words, _premultiplied, _reduce_locally, _scaled
from podsim._wire import PodsimError


def naive(rows, combine):
    out = rows[0].clone()
    for row in rows[1:]:
        out = combine(out, row)
    return out


class LocalReductions(unittest.TestCase):
    def setUp(self):
        generator = torch.Generator().manual_seed(7)
        self.floats = torch.randn(5, 33, generator=generator)
        self.ints = torch.randint(-1000, 1000, (5, 33), generator=generator)

    def test_each_op_is_its_elementwise_fold_in_rank_order(self):
        cases = [
            (dist.ReduceOp.SUM, self.floats, lambda a, b: a + b),
            (dist.ReduceOp.PRODUCT, self.floats, lambda a, b: a * b),
            (dist.ReduceOp.MAX, self.floats, torch.maximum),
            (dist.ReduceOp.MIN, self.floats, torch.minimum),
            (dist.ReduceOp.BAND, self.ints, torch.bitwise_and),
            (dist.ReduceOp.BOR, self.ints, torch.bitwise_or),
            (dist.ReduceOp.BXOR, self.ints, torch.bitwise_xor),
        ]
        for op, rows, combine in cases:
            with self.subTest(op=str(op)):
                got = _reduce_locally(rows, op)
                want = naive(rows, combine)
                self.assertEqual(got.dtype, rows.dtype)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    def test_average_is_the_sum_over_the_ranks(self):
        got = _reduce_locally(self.floats, dist.ReduceOp.AVG)
        torch.testing.assert_close(got, naive(self.floats, lambda a, b: a + b) / 5)

    def test_integer_sums_stay_integers(self):
        got = _reduce_locally(self.ints, dist.ReduceOp.SUM)
        self.assertEqual(got.dtype, torch.int64)
        self.assertTrue(torch.equal(got, naive(self.ints, lambda a, b: a + b)))

    def test_an_op_no_one_does_is_an_error(self):
        with self.assertRaises((PodsimError, ValueError, TypeError)):
            _reduce_locally(self.floats, dist.ReduceOp.PREMUL_SUM)

    def test_a_premultiplied_sum_is_the_sum_of_the_scaled_inputs(self):
        op, factor = _premultiplied(dist.ReduceOp.PREMUL_SUM(0.25))
        self.assertTrue(op == dist.ReduceOp.SUM)
        got = _reduce_locally(_scaled(self.floats, factor), op)
        want = naive(self.floats * 0.25, lambda a, b: a + b)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    def test_other_ops_are_not_scaled(self):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            with self.subTest(op=str(op)):
                same, factor = _premultiplied(op)
                self.assertTrue(same == op)
                self.assertIs(_scaled(self.floats, factor), self.floats)


class RawWords(unittest.TestCase):
    def test_every_dtype_and_odd_byte_count_round_trips_bit_for_bit(self):
        for dtype in (torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.int64,
                      torch.float64, torch.bool):
            for n in (1, 3, 7, 64):
                with self.subTest(dtype=str(dtype), n=n):
                    like = (torch.arange(n) * 37 % 251).to(dtype)
                    words = _as_words(like)
                    self.assertEqual(words.dtype, torch.float32)
                    self.assertEqual(words.numel() * 4, -(-like.numel() * like.element_size() // 4) * 4)
                    back = _from_words(words.clone(), like)
                    self.assertTrue(torch.equal(back.view(torch.uint8), like.view(torch.uint8)))


if __name__ == "__main__":
    unittest.main()
