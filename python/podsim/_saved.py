"""Which of a rank's live storages autograd saved for backward: HBM's *saved activations*,
apart from the *transients* an op makes and frees.

A pair of saved-tensor hooks at the bottom of the rank's hook stack sees every tensor an op
saves for its backward (`pack`), and moves its storage from transients to saved activations
(parameters, gradients and optimizer state keep their kind). Two places hide saved tensors
from such hooks, and are reached here:

- `torch.utils.checkpoint`: inside a checkpointed region its own hooks replace the stack's
  (nothing is saved in forward: right), and the forward it runs again in backward saves
  through its recomputation hook, whose pack is wrapped to mark what it keeps;
- `torch.func.grad` and its kin refuse to run under any saved-tensor hooks
  (`disable_saved_tensors_hooks`): these hooks step aside while they run.

The pack is marked as one of checkpoint's own (`_checkpoint_internal`, with no user hooks
beneath), so checkpoint neither hands it recomputed tensors a second time nor warns that a
user's hooks surround a selective-checkpoint region. Selective checkpointing's cache of the
ops its policy saves is not a saved-tensor hook: those stay transients.
"""

import contextlib

import torch

# The rank's counter (`podsim._compute.Compute`), whose `memory` the saves are marked in.
_compute = None


def _pack(tensor):
    # A replayed step counts nothing (its HBM is the recorded step's): no work here either.
    if _compute is not None and _compute.counting():
        _compute.memory.saved(tensor)
    return tensor


def _unpack(tensor):
    return tensor


_pack._checkpoint_internal = True
_pack._user_hooks = None


def install(compute):
    """Counts saved activations in `compute.memory` from now on, while `compute` counts, on
    this thread (autograd's backward threads inherit the hooks)."""
    global _compute
    installed, _compute = _compute is not None, compute
    if not installed:
        torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)
        _recomputation_marks_what_it_keeps()
        _steps_aside_where_hooks_are_refused()


def _recomputation_marks_what_it_keeps():
    from torch.utils import checkpoint

    hook = checkpoint._recomputation_hook
    init = hook.__init__

    def marking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        keep = self.pack_hook

        def pack_hook(x):
            _pack(x)
            return keep(x)

        pack_hook._checkpoint_internal = True
        self.pack_hook = pack_hook

    hook.__init__ = marking_init


def _steps_aside_where_hooks_are_refused():
    graph = torch.autograd.graph
    refuse = graph.disable_saved_tensors_hooks

    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message):
        ours = torch._C._autograd._top_saved_tensors_default_hooks(True) == (_pack, _unpack)
        if ours:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        try:
            with refuse(error_message):
                yield
        finally:
            if ours:
                torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)

    graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks
