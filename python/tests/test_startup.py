"""What a rank loads before its program runs: podsim's interceptions load neither FSDP nor
DTensor (nor sympy with them), yet patch their modules when the program loads them. Each
check runs in a fresh interpreter, as a rank starts."""

import os
import subprocess
import sys
import unittest

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_fresh_python(code):
    """`code` run after `podsim._intercept.install()` in a new interpreter: its output."""
    env = dict(os.environ, PYTHONPATH=PACKAGE, PODSIM_MODE="data")
    run = subprocess.run(
        [sys.executable, "-c", "import podsim._intercept as i\ni.install()\n" + code],
        env=env, capture_output=True, text=True, timeout=120,
    )
    if run.returncode != 0:
        raise AssertionError(run.stderr[-2000:])
    return run.stdout


class Startup(unittest.TestCase):
    def test_fsdp_dtensor_and_sympy_are_not_loaded_up_front(self):
        out = in_fresh_python(
            "import sys\n"
            "for name in ('torch.distributed.fsdp', 'torch.distributed.tensor', 'sympy'):\n"
            "    print(name, name in sys.modules)\n"
        )
        self.assertEqual(out.split(), [
            "torch.distributed.fsdp", "False", "torch.distributed.tensor", "False",
            "sympy", "False",
        ])

    def test_modules_loaded_later_get_podsims_device_handles(self):
        out = in_fresh_python(
            "import sys\n"
            "import torch.distributed.fsdp, torch.distributed.tensor\n"
            "from torch.distributed.fsdp._fully_shard import _fsdp_collectives as c\n"
            "for name, m in sorted(sys.modules.items()):\n"
            "    h = getattr(m, '_get_device_handle', None)\n"
            "    if name.startswith('torch.distributed') and h is not None:\n"
            "        print(name, h.__name__)\n"
            "print('record', c.record_grad_output_stream.__qualname__)\n"
        )
        handles = dict(line.split() for line in out.splitlines())
        self.assertIn("<lambda>", handles.pop("record"))  # podsim's, which records nothing
        self.assertTrue(handles)
        for name, handle in handles.items():
            fsdp = name.startswith("torch.distributed.fsdp._fully_shard")
            self.assertEqual(handle, "fsdp_device_handle" if fsdp else "device_handle", name)


if __name__ == "__main__":
    unittest.main()
