"""The fused eager mode's kernels and the HBM they hold, counted on CPU tensors in this process:
no podsim binary, no process group. Each expected figure is worked out by hand from the ops."""

import unittest

import torch

from podsim._compute import Compute, Memory

N = 1 << 16  # elements per tensor: big enough that no op is free, small enough to run quickly


def counted(fn, eager="fused"):
    """`fn()` under a dispatch count with HBM tracked: (compute taken, memory, fn's result)."""
    compute = Compute(eager)
    compute.memory = Memory("cpu", 0, "test chip")
    with compute:
        out = fn()
        compute.end_kernels()
        taken = compute.take()
    return taken, compute.memory, out


class FusedKernels(unittest.TestCase):
    def test_a_chain_reads_its_input_once_and_writes_its_result_once(self):
        x = torch.ones(N, dtype=torch.bfloat16)
        taken, memory, out = counted(lambda: x.float().mul(2).add(1))
        self.assertEqual(taken["kernels"], 1)
        self.assertEqual(taken["pass_bytes"], 2 * N + 4 * N)
        self.assertEqual(memory.peak, 4 * N)  # the result alone: intermediates were never in HBM
        self.assertEqual(out[0].item(), 3.0)

    def test_strict_mode_makes_every_op_its_own_kernel(self):
        x = torch.ones(N, dtype=torch.bfloat16)
        taken, memory, _ = counted(lambda: x.float().mul(2).add(1), eager="strict")
        self.assertEqual(taken["kernels"], 3)
        self.assertEqual(taken["pass_bytes"], (2 * N + 4 * N) + 2 * (4 * N + 4 * N))
        # Each result lives until the op reading it has made the next.
        self.assertEqual(memory.peak, 2 * 4 * N)

    def test_an_unrelated_op_in_between_does_not_split_a_kernel(self):
        x = torch.ones(N, dtype=torch.bfloat16)
        other = torch.ones(N)

        def program():
            y = x.float()
            unrelated = other * 2
            return y.exp(), unrelated

        taken, _, _ = counted(program)
        self.assertEqual(taken["kernels"], 2)
        self.assertEqual(taken["pass_bytes"], (2 * N + 4 * N) + (4 * N + 4 * N))

    def test_a_kept_intermediate_cheaper_to_recompute_is_not_stored(self):
        x = torch.ones(N, dtype=torch.bfloat16)
        kept = []

        def program():
            y = x.float()  # 4N bytes, recomputable from x's 2N
            kept.append(y)
            return y.exp()

        taken, memory, _ = counted(program)
        self.assertEqual(taken["pass_bytes"], 2 * N + 4 * N)
        self.assertEqual(memory.peak, 4 * N)
        # A matrix product reading it later recomputes it: one more pass over x.
        compute = Compute("fused")
        compute.memory = Memory("cpu", 0, "test chip")
        compute.fusion.recomputable = dict(memory_free_recomputable(compute.fusion, kept[0], x))
        with compute:
            kept[0].view(256, -1) @ torch.ones(N // 256, 2)
            compute.end_kernels()
            again = compute.take()
        self.assertEqual(again["pass_bytes"], 2 * N)

    def test_a_kept_intermediate_dearer_to_recompute_is_stored(self):
        a, b = torch.ones(N), torch.ones(N)
        kept = []

        def program():
            s = a + b  # 4N bytes from 8N of sources: written
            kept.append(s)
            return s.exp()

        taken, memory, _ = counted(program)
        self.assertEqual(taken["pass_bytes"], 8 * N + 4 * N + 4 * N)
        self.assertEqual(memory.peak, 2 * 4 * N)

    def test_an_intermediate_autograd_saves_is_counted_when_stored(self):
        x = torch.ones(N, requires_grad=True)
        w = torch.ones(N, requires_grad=True)

        def program():
            # exp's backward keeps exp's result, whose sources (x, w: 8N) cost more than it
            # (4N): written. x * w is kept by nothing (mul's backward keeps x and w): never.
            return (x * w).exp().sum()

        taken, memory, loss = counted(program)
        self.assertEqual(memory.peak, 4 * N + 4)
        self.assertEqual(taken["kernels"], 1)
        loss.backward()

    def test_an_open_kernel_does_not_keep_an_input_the_program_freed(self):
        compute = Compute("fused")
        compute.memory = Memory("cpu", 0, "test chip")
        with compute:
            # A matrix product's result is in HBM at once (16N bytes).
            big = (torch.ones(4 * N // 256, 16) @ torch.ones(16, 256)).view(-1)
            small = big[:4].exp()  # a kernel reading `big`'s storage, left open
            del big
            # The program let go of `big`: HBM holds the open kernel's result at most, not
            # its 16N-byte input until the kernel closes.
            self.assertLess(compute.memory.total, 4 * N)
            compute.end_kernels()
        self.assertEqual(small.tolist(), [torch.tensor(16.0).exp().item()] * 4)

    def test_a_kernel_open_at_a_collective_is_priced_for_its_reads_then_its_writes_later(self):
        x = torch.ones(N, dtype=torch.bfloat16)
        compute = Compute("fused")
        compute.memory = Memory("cpu", 0, "test chip")
        with compute:
            y = x.float()
            at_collective = compute.take()  # a collective's request takes the compute so far
            z = y.exp()
            del y  # gone before the kernel closes: never written
            compute.end_kernels()
            at_step = compute.take()
        self.assertEqual(at_collective["pass_bytes"], 2 * N)
        self.assertEqual(at_collective["kernels"], 0)
        self.assertEqual((at_step["pass_bytes"], at_step["kernels"]), (4 * N, 1))
        self.assertEqual(compute.memory.peak, 4 * N)
        self.assertEqual(z.dtype, torch.float32)


def memory_free_recomputable(fusion, value, source):
    """A `Fusion.recomputable` entry of `fusion` for `value`, recomputed from `source`."""
    stored = source.untyped_storage()
    return {fusion.key(value.untyped_storage()): (source.nbytes, {
        fusion.key(stored): (source.nbytes, stored)})}


class NotTheChips(unittest.TestCase):
    def test_fake_tensors_a_mode_above_makes_are_not_hbm(self):
        """DTensor's sharding propagation makes its global-shape arguments under a
        FakeTensorMode pushed above the rank's count; in meta mode they are meta tensors like
        the chip's own, and once counted they put torchtitan's Llama 3 8B optimizer step at
        95 GiB on 4,096 chips."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        def make():
            mine = torch.empty(N, device="meta")
            with FakeTensorMode():
                fake = torch.empty_strided((N, 1024), (1024, 1), device="meta")
                fake.add_(1)
            return mine

        compute = Compute("strict")
        compute.memory = Memory("meta", 0, "test chip")
        with compute:
            mine = make()
        self.assertEqual(compute.memory.peak, mine.nbytes)  # the plain tensor alone


if __name__ == "__main__":
    unittest.main()
