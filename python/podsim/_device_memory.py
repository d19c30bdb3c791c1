"""``torch.cuda``'s memory API on the modelled chip: a program that logs its memory as it
would on a GPU (``max_memory_allocated``, ``memory_stats``, ``mem_get_info``,
``get_device_properties(...).total_memory``, as torchtitan's memory monitor does) reads the
chip's HBM capacity and the bytes podsim counts at the dispatcher (:class:`podsim._compute.
Memory`), the same figures ``report.json`` gives.

Nothing is cached or reserved beside what is live, so reserved equals allocated; before the
rank's process group exists, and with compute counting off, nothing is counted and the figures
are zero.
"""

import os
from dataclasses import dataclass

import torch

from . import torch as backend


@dataclass(frozen=True)
class ChipProperties:
    """What ``torch.cuda.get_device_properties`` returns for the modelled chip (the fields
    programs read; the rest of a GPU's do not apply)."""

    name: str
    total_memory: int
    major: int = 0
    minor: int = 0
    multi_processor_count: int = 1
    is_integrated: bool = False


def capacity() -> int:
    """The modelled chip's HBM, bytes (as the worker set it)."""
    return int(float(os.environ.get("PODSIM_HBM_BYTES", "0")))


def _memory():
    """The rank's HBM counter, when there is one yet."""
    rank = backend._rank
    return None if rank is None else getattr(rank.compute, "memory", None)


def allocated(device=None) -> int:
    memory = _memory()
    return 0 if memory is None else memory.total


def max_allocated(device=None) -> int:
    memory = _memory()
    return 0 if memory is None else memory.program_peak


def reset_peak(device=None) -> None:
    memory = _memory()
    if memory is not None:
        memory.reset_program_peak()


def stats(device=None) -> dict:
    """``torch.cuda.memory_stats``'s keys that describe what is live and its peak."""
    now, peak = allocated(), max_allocated()
    out = {"num_alloc_retries": 0, "num_ooms": 0}
    for name in ("allocated_bytes", "active_bytes", "reserved_bytes"):
        out[f"{name}.all.current"] = now
        out[f"{name}.all.peak"] = peak
    return out


def install() -> None:
    """Points ``torch.cuda``'s memory functions at the chip."""
    cuda = torch.cuda
    name = os.environ.get("PODSIM_HARDWARE", "podsim")
    cuda.get_device_properties = lambda device=None: ChipProperties(name, capacity())
    cuda.mem_get_info = lambda device=None: (capacity() - allocated(), capacity())
    cuda.memory_allocated = allocated
    cuda.memory_reserved = allocated
    cuda.max_memory_allocated = max_allocated
    cuda.max_memory_reserved = max_allocated
    cuda.memory_stats = stats
    cuda.reset_peak_memory_stats = reset_peak
    cuda.reset_max_memory_allocated = reset_peak
    cuda.empty_cache = lambda: None
