"""`torch.cuda`'s memory API on the modelled chip (`podsim._device_memory`): the capacity the
worker gives, and the bytes the rank's HBM counter holds, with a peak the program resets."""

import os
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from podsim import _device_memory
from podsim import torch as backend
from podsim._compute import Memory

GIB = 1 << 30


class DeviceMemory(unittest.TestCase):
    def setUp(self):
        self.memory = Memory("cpu", 0, "test chip")
        rank = SimpleNamespace(compute=SimpleNamespace(memory=self.memory))
        patches = [mock.patch.object(backend, "_rank", rank),
                   mock.patch.dict(os.environ, {"PODSIM_HBM_BYTES": str(95 * GIB),
                                                "PODSIM_HARDWARE": "v5p"})]
        for p in patches:
            p.start()
            self.addCleanup(p.stop)

    def hold(self, nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.memory.track(t.untyped_storage(), "test")
        return t

    def test_torch_cuda_reports_the_chip(self):
        _device_memory.install()  # what a rank's interpreter does before the program
        a = self.hold(1 * GIB)
        props = torch.cuda.get_device_properties(0)
        self.assertEqual((props.name, props.total_memory), ("v5p", 95 * GIB))
        self.assertEqual(torch.cuda.mem_get_info(), (94 * GIB, 95 * GIB))
        self.assertEqual(torch.cuda.max_memory_allocated(), 1 * GIB)
        torch.cuda.reset_peak_memory_stats()
        del a
        self.assertEqual(torch.cuda.memory_stats()["allocated_bytes.all.peak"], 1 * GIB)

    def test_allocated_and_peak_follow_the_counter_until_reset(self):
        a = self.hold(1000)
        b = self.hold(500)
        self.assertEqual(_device_memory.allocated(), 1500)
        del b
        self.assertEqual(_device_memory.allocated(), 1000)
        self.assertEqual(_device_memory.max_allocated(), 1500)
        stats = _device_memory.stats()
        self.assertEqual((stats["active_bytes.all.peak"], stats["reserved_bytes.all.current"]),
                         (1500, 1000))
        _device_memory.reset_peak()
        self.assertEqual(_device_memory.max_allocated(), 1000)
        del a

    def test_a_replayed_steps_peak_counts(self):
        self.memory.replayed(7000)
        self.assertEqual(_device_memory.max_allocated(), 7000)

    def test_before_the_process_group_everything_is_zero(self):
        with mock.patch.object(backend, "_rank", None):
            self.assertEqual((_device_memory.allocated(), _device_memory.max_allocated()), (0, 0))


if __name__ == "__main__":
    unittest.main()
