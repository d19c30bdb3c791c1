"""Counting a training program's repeated step once.

Counting every op at the dispatcher (`podsim._compute`, a Python mode per op) costs a small
model most of its wall time, and training repeats one step. A rank therefore records each step
it counts: the requests it made to its chip in order - each with its kind (collective, group,
size, dtype; a wait and how many works it waits for; the step's end) and the compute run
before it - the torch calls it made, and the step's HBM. Once two steps in a row are alike it
stops counting (the dispatch mode leaves the stack) and charges each later step the recorded
compute, request by request, so virtual time and overlap come out as if every op had been
counted.

What keeps this honest:
- A torch function mode (far cheaper than the dispatch mode) folds every torch call and the
  shape of its first argument into a running hash, checked call by call against the
  recording, and each request must be the one the recording made at that point. The first
  call or request that differs (a `.item()` for a log line, a batch of another length,
  another collective) ends replaying, and counting resumes at that call. When it is the first
  call since a request (a log line after the optimizer's step), what came before is the
  recording's to the letter and the step is exact (`counted`). Otherwise what ran since the
  previous request is not seen and the step is `partial`; so is one that differs inside
  autograd's backward, where counting resumes only at the step's end: torch restores its
  thread-local state (the mode stack among it) around every node there, so a mode pushed
  there would not stay.
- A step that diverged at a request boundary is known whole: it is kept as a variant (up to
  `VARIANTS`), and a later step that leaves the steady one where it did switches to it and
  stays replayed (the step that logs every N steps costs nothing after its first time).
- After a `partial` step one step is counted; if it is the recorded one, replaying goes on,
  otherwise steps are counted until two agree again.
- Every `RECOUNT_EVERY`-th step is counted again and compared with the recording.
- A replayed step's outermost `optimizer.step()` runs with the function mode set aside, when
  the recording made one at the same point and it is given no closure: an optimizer makes
  the same calls on the same parameters every step (its requests are still checked), and the
  mode costs each of its calls a trip through Python, in a small model a third of the step.
  Its calls are then taken as the recording's; a request that differs inside it ends
  replaying (`partial`).
- `[job] count = "every"` (`--set job.count=every`) counts every step.
"""

import os
import sys
import traceback

import torch

# A steady program is counted again every this many steps, to catch a change its torch calls
# do not show (they show batch shapes, log lines, other collectives). Its cost is one counted
# step, 3 to 5 times a replayed one, in this many. `PODSIM_RECOUNT_EVERY` sets another (the
# tests of replay, to meet recounts in fewer steps).
RECOUNT_EVERY = int(os.environ.get("PODSIM_RECOUNT_EVERY", "50"))
# Variants of the steady step kept besides it (a step that logs, one that evaluates).
VARIANTS = 4

# What a step's compute was, as the report gives it.
COUNTED, REPLAYED, PARTIAL = "counted", "replayed", "partial"

# Request fields that differ between alike steps (ids, lines) or are the compute itself.
_NOT_SIGNATURE = frozenset({"work", "compute", "site", "waits", "hbm", "stand_ins"})


def signature(request, payload):
    """What must repeat for a request to be the same request in another step."""
    fields = tuple(sorted((k, v) for k, v in request.items() if k not in _NOT_SIGNATURE))
    size = payload.numel() if isinstance(payload, torch.Tensor) else None
    return fields, size


class _Recording:
    """A counted step: its requests `[(signature, compute)]`, the running hash after each of
    its torch calls, and its HBM."""

    __slots__ = ("requests", "calls", "hbm", "optimizer_steps")

    def __init__(self, requests, calls, hbm, optimizer_steps):
        self.requests, self.calls, self.hbm = requests, calls, hbm
        # The outermost `optimizer.step()`s, as `{first call: end}` indexes into `calls`.
        self.optimizer_steps = optimizer_steps

    def same_work(self, other):
        """The same requests after the same torch calls (HBM aside: a step counted after
        replayed ones has not seen what they allocated)."""
        return (
            isinstance(other, _Recording)
            and self.requests == other.requests
            and self.calls == other.calls
        )


class Steps:
    """One rank's steps: counted (the dispatch mode on the stack) or replayed from the steady
    one."""

    def __init__(self, compute, replay=True):
        self.compute = compute
        self.replay = replay
        self.counting = True
        self.state = COUNTED
        # This step so far: its requests, and the running hash after each torch call.
        self.requests = []
        self.calls = []
        self.hash = 0
        # Torch calls since the last request; whether counting resumed within this step.
        self.segment_calls = 0
        self.resumed = False
        # The previous step when it was counted whole; the steady step and its variants (the
        # steady one first); the one this step is replayed from.
        self.last = None
        self.recordings = []
        self.recording = None
        self.since_count = 0
        # This step's outermost `optimizer.step()`s so far (`_Recording.optimizer_steps`),
        # the first call of the one running, and the function mode while it is set aside.
        self.optimizer_steps = {}
        self.optimizer_from = None
        self.aside = None
        intercept = sys.modules.get("podsim._intercept")
        if intercept is not None and intercept.DeviceMap.active:
            intercept.DeviceMap.observer = self.called
            self.mode = intercept.DeviceMap.entered
        else:
            self.mode = _Calls(self)
            self.mode.__enter__()

    # -- what the rank calls --

    def take(self, sig):
        """The compute to send with a request of signature `sig`."""
        segment_calls, self.segment_calls = self.segment_calls, 0
        if self.state != REPLAYED:
            compute = self.compute.take()
            self.requests.append((sig, compute))
            return compute
        recorded = self.recording.requests
        i = len(self.requests)
        if i < len(recorded) and recorded[i][0] == sig and self._calls_match():
            self.requests.append(recorded[i])
            return recorded[i][1]
        if self._switch(sig):
            self.requests.append(self.recording.requests[i])
            return self.recording.requests[i][1]
        self._diverged(exact=segment_calls == 0)
        compute = self.compute.take()
        self.requests.append((sig, compute))
        return compute

    def end_step(self, sig, hbm):
        """The step's end, its request of signature `sig`, with the HBM counted over it.
        Returns the compute to send with the request, the step's HBM, and what the step was
        (`counted`, `replayed` or `partial`)."""
        # A replayed step ends at its recording's end: a step request is only ever the last.
        compute = self.take(sig)
        self._step_back()  # an optimizer step that never ended (it raised, and was caught)
        state = self.state
        counted = (_Recording(self.requests, self.calls, hbm, self.optimizer_steps)
                   if state == COUNTED else None)
        if self.recording is not None and (
            state != COUNTED or self.resumed or counted.same_work(self.recording)
        ):
            # Storages live since replayed steps were never seen allocated: the recorded peak
            # stands unless this step's is higher.
            hbm = max(hbm, self.recording.hbm, key=lambda h: h["peak_bytes"])
            if counted is not None:
                counted.hbm = hbm
        self._next_step(counted, state)
        return compute, hbm, state

    def optimizer_step_begins(self, closure=False):
        """The outermost `optimizer.step()` begins: counting, where it begins is noted;
        replaying a recording that began one here, the function mode steps aside, unless the
        step was given a closure (which runs the program's forward and backward inside it)."""
        n = len(self.calls)
        self.optimizer_from = n
        if self.state == REPLAYED and not closure and n in self.recording.optimizer_steps:
            self.aside = self.mode_aside()

    def optimizer_step_ends(self):
        """The outermost `optimizer.step()` ends: counting, its calls are noted; replaying
        with the mode aside, the mode comes back and the recording's calls stand for the
        step's."""
        first, self.optimizer_from = self.optimizer_from, None
        if first is None:
            return
        if self.aside is None:
            if self.state != REPLAYED:
                self.optimizer_steps[first] = len(self.calls)
            return
        self._step_back()
        end = self.recording.optimizer_steps.get(first)
        if end is None:  # a variant switched to at a request inside it, which has none here
            self._diverged(exact=False)
            return
        self.calls.extend(self.recording.calls[first:end])
        self.segment_calls += end - first
        self.hash = self.calls[-1] if self.calls else 0

    def mode_aside(self):
        """Takes the rank's torch function mode off the stack, when it is on top and may
        leave it; returns it, to be entered again, or None."""
        mode = self.mode
        if not mode.can_step_aside or torch.overrides._get_current_function_mode() is not mode:
            return None
        mode.__exit__(None, None, None)
        return mode

    def _step_back(self):
        if self.aside is not None:
            self.aside.__enter__()
            self.aside = None

    def called(self, func, args):
        """A torch call (from a torch function mode's handler, called from the program's
        frame or podsim's, whose bookkeeping runs only while counting and is left out)."""
        if sys._getframe(2).f_code.co_filename.startswith(_PODSIM_DIR):
            return
        # An aten op reaching a function mode is called from a dispatch mode's handler
        # (podsim's own, which runs only while counting), through torch's `_ops.py`.
        if isinstance(func, torch._ops.OpOverload):
            return
        first = getattr(args[0], "shape", None) if args else None
        try:
            self.hash = hash((self.hash, func, first))
        except TypeError:  # a first argument whose `shape` is no value
            self.hash = hash((self.hash, func))
        self.calls.append(self.hash)
        self.segment_calls += 1
        if self.state == REPLAYED and not self._calls_match() and not self._switch():
            self._diverged(exact=self.segment_calls == 1)

    # -- deciding how steps run --

    def _calls_match(self):
        n = len(self.calls)
        recorded = self.recording.calls
        return n == 0 or (n <= len(recorded) and recorded[n - 1] == self.calls[-1])

    def _switch(self, sig=None):
        """Replays from a variant that made this step's calls and requests so far (and the
        request of signature `sig`, when given), if one did."""
        n = len(self.calls)
        done = [r[0] for r in self.requests] + ([sig] if sig is not None else [])
        for variant in self.recordings:
            if variant is self.recording or len(variant.calls) < n:
                continue
            if (n == 0 or variant.calls[n - 1] == self.calls[-1]) and [
                r[0] for r in variant.requests[: len(done)]
            ] == done:
                self.recording = variant
                return True
        return False

    def _diverged(self, exact):
        """This step is not the recorded one: replaying ends here. `exact`: nothing ran since
        the last request that matched."""
        if _DEBUG:
            print(f"podsim replay: step diverged (exact={exact}, call {len(self.calls)}) at "
                  f"{''.join(traceback.format_stack(limit=8)[:-2])}", file=sys.stderr)
        if self.aside is not None:  # inside an optimizer step, its calls unseen
            self._step_back()
            exact = False
        if torch._C._current_graph_task_id() != -1:  # inside backward
            self.state = PARTIAL
            return
        self._count()
        self.state = COUNTED if exact else PARTIAL
        self.resumed = True

    def _next_step(self, counted, state):
        """Decides how the next step runs: counted, or replayed from the recording."""
        self.requests, self.calls, self.hash = [], [], 0
        self.optimizer_steps, self.optimizer_from = {}, None
        fully_counted = state == COUNTED and not self.resumed
        self.since_count = 0 if fully_counted else self.since_count + 1
        steady = self.recordings[0] if self.recordings else None
        if counted is not None:
            if steady is not None and self.resumed:
                if not any(counted.same_work(r) for r in self.recordings):
                    # Known whole: a variant (the steady step stays first).
                    self.recordings = [steady, counted, *self.recordings[1:VARIANTS]]
            elif steady is not None and not any(counted.same_work(r) for r in self.recordings):
                self.recordings = []  # a recount, or the step after a partial, differs
            elif steady is None and counted.same_work(self.last):
                counted.hbm = max(counted.hbm, self.last.hbm, key=lambda h: h["peak_bytes"])
                self.recordings = [counted]
        self.recording = self.recordings[0] if self.recordings else None
        self.last = counted
        self.resumed = False
        replay = (
            self.replay
            and state != PARTIAL
            and self.recording is not None
            and self.since_count < RECOUNT_EVERY
        )
        if replay and self._stop_counting():
            self.state = REPLAYED
            return
        self._count()
        self.state = COUNTED

    def _count(self):
        if not self.counting:
            # What reached the counter while replaying (attention priced outside the mode)
            # belongs to replayed requests.
            self.compute.take()
            self.compute.__enter__()
            self.counting = True

    def _stop_counting(self):
        """Takes the dispatch mode off the stack, if it is on top (a mode the program entered
        above it keeps the rank counting)."""
        if not self.counting:
            return True
        if torch.utils._python_dispatch._get_current_dispatch_mode() is not self.compute:
            return False
        self.compute.take()
        self.compute.__exit__(None, None, None)
        self.counting = False
        return True


# podsim's own code: its torch calls are bookkeeping that runs only while counting (HBM
# classes, the dispatch mode's own), not the program's.
_PODSIM_DIR = os.path.dirname(os.path.abspath(__file__))
# `PODSIM_REPLAY_DEBUG=1`: where each replayed step stopped being the recorded one.
_DEBUG = os.environ.get("PODSIM_REPLAY_DEBUG") == "1"


class _Calls(torch.overrides.TorchFunctionMode):
    """Tells `steps` of every torch call (functions and tensor methods) on this thread, when
    no device map of `podsim._intercept` does."""

    can_step_aside = True

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.steps.called(func, args)
        return func(*args, **(kwargs or {}))
