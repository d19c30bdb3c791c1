"""Balanced counts (`podsim._meta_counts`): the values meta mode gives integer tensors derived
from a router's choice, checked against the closed form of balanced routing. No podsim
binary, no process group: the rules are applied as meta mode's function mode applies them."""

import unittest

import torch

from podsim import _meta_counts

T, E, K, RANKS = 4096, 16, 2, 4


class Tracking(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        _meta_counts.carry(func, args, kwargs or {}, out)
        return out


def routed_counts():
    """Tokens per expert of a top-k router, as torchtitan counts them."""
    scores = torch.empty(T, E, device="meta")
    ids = scores.topk(K, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
    return routing_map.sum(dim=0)


def exchange(counts):
    """A framework's own collective (not one of torch's): as many counts, moved."""
    return counts


class BalancedCounts(unittest.TestCase):
    def test_a_routing_maps_counts_are_the_tokens_spread_evenly(self):
        with Tracking():
            counts = routed_counts()
            per_rank = counts.view(RANKS, -1).sum(dim=1)
        self.assertEqual(_meta_counts.mean_of(counts), T * K / E)
        self.assertEqual(_meta_counts.balanced(per_rank).tolist(), [T * K // RANKS] * RANKS)

    def test_a_histogram_spreads_its_values_over_its_bins(self):
        with Tracking():
            ids = torch.empty(T * K, device="meta")
            counts = torch.histc(ids, bins=E, min=0, max=E)
        self.assertEqual(_meta_counts.balanced(counts).sum().item(), T * K)

    def test_an_uneven_total_keeps_its_exact_sum(self):
        with Tracking():
            counts = torch.zeros(7, dtype=torch.long, device="meta").scatter_(
                0, torch.empty(3, dtype=torch.long, device="meta"), 1)
        values = _meta_counts.balanced(counts)
        self.assertEqual(values.sum().item(), 3)
        self.assertLessEqual(values.max().item() - values.min().item(), 1)

    def test_collectives_keep_the_means_of_every_rank(self):
        with Tracking():
            counts = routed_counts()
            chunks = list(counts.view(RANKS, -1).unbind(0))
            received = [torch.empty_like(c) for c in chunks]
        _meta_counts.carry_collective(received, chunks)
        with Tracking():
            together = torch.stack(received)
            total = counts.clone()
        self.assertEqual(_meta_counts.mean_of(together), T * K / E)
        _meta_counts.carry_collective([total], [total], factor=RANKS)
        self.assertEqual(_meta_counts.mean_of(total), RANKS * T * K / E)

    def test_a_function_without_a_rule_that_moves_counts_keeps_their_mean(self):
        with Tracking():
            counts = routed_counts()
            moved = torch.roll(counts, 1)
        _meta_counts.carry(exchange, (counts,), {}, moved)  # as meta mode's mode would
        self.assertEqual(_meta_counts.mean_of(moved), T * K / E)

    def test_comparisons_of_counts_and_of_masks(self):
        with Tracking():
            counts = routed_counts()
            mask = torch.nn.functional.one_hot(torch.empty(T, dtype=torch.long, device="meta"), E)
            every_expert_used = counts > 0  # balanced: every count is its mean
            none_over = counts > T * K  # and none is over the tokens routed
            ones, zeros = mask != 0, mask == 0
        self.assertEqual(_meta_counts.mean_of(every_expert_used), 1.0)
        self.assertEqual(_meta_counts.mean_of(none_over), 0.0)
        self.assertEqual(_meta_counts.mean_of(ones), 1 / E)
        self.assertEqual(_meta_counts.mean_of(zeros), 1 - 1 / E)

    def test_in_place_writes_keep_what_they_know_and_forget_the_rest(self):
        with Tracking():
            counts = routed_counts()
            total = torch.zeros(E, dtype=torch.long, device="meta")
            total.add_(counts)
            total.add_(counts)
            overwritten = routed_counts()
            overwritten.copy_(torch.empty(E, dtype=torch.long, device="meta"))
        self.assertEqual(_meta_counts.mean_of(total), 2 * T * K / E)
        self.assertIsNone(_meta_counts.mean_of(overwritten))

    def test_values_that_differ_from_their_arguments_carry_no_mean(self):
        with Tracking():
            counts = routed_counts()
            offsets, doubled = counts.cumsum(0), counts * 2
            negative = torch.full((E,), -100, device="meta") > 0
        self.assertIsNone(_meta_counts.mean_of(offsets))
        self.assertIsNone(_meta_counts.mean_of(doubled))
        self.assertEqual(_meta_counts.mean_of(negative), 0.0)

    def test_subtracting_in_place_with_alpha(self):
        with Tracking():
            counts = routed_counts()
            left = counts.clone().add_(counts, alpha=-1)
        self.assertEqual(_meta_counts.mean_of(left), 0.0)

    def test_floating_point_data_carries_nothing(self):
        with Tracking():
            x = torch.zeros_like(torch.empty(8, device="meta"))
        self.assertIsNone(_meta_counts.mean_of(x))
        self.assertIsNone(_meta_counts.balanced(x))


if __name__ == "__main__":
    unittest.main()
