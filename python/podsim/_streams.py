"""Streams and events on the chip's clocks, so that communication overlaps compute as it does
on an accelerator.

A rank's compute runs on its default stream: the chip's clock. A collective issued while
another stream is current (FSDP2's all-gather and reduce-scatter streams, a program's own
`torch.cuda.stream(s)`), or issued with `async_op=True`, runs on one of the chip's
communication streams from the moment it is issued, and the compute stream waits for it only
where the program says so: `work.wait()` with the default stream current,
`current_stream().wait_event(e)` / `wait_stream(s)` for the collectives recorded in `e` or
`s`, `synchronize()`, and `optimizer.step()` (DDP waits for its buckets through futures the
chip does not see; the optimizer needs every gradient). A wait travels with the next request
to the chip together with the compute run before it, so waiting costs no round trip.

FSDP2 gets these streams as its device handle (`_get_device_handle` for the CPU and meta
devices), and `torch.cuda.Stream`, `Event`, `stream`, `current_stream`, `synchronize` are
these under the interception.
"""

import contextlib
import os
import threading

_local = threading.local()
# `strict` and `debug` eager modes: every collective is waited for when issued.
_SYNC = os.environ.get("PODSIM_EAGER", "fused") in ("strict", "debug")


class Event:
    """The collectives pending on a stream when the event was recorded; with
    `enable_timing`, the chip's virtual clock there, so `elapsed_time` is the modelled time
    between two events (a program that times its steps with CUDA events reads virtual
    milliseconds, as it would read the device's)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **_):
        self.works = ()
        self.timing = enable_timing
        self.clock_ns = None

    def record(self, stream=None):
        stream = stream if stream is not None else current_stream()
        self.works = stream.outstanding()
        if self.timing:
            self.clock_ns = _clock_ns()

    def wait(self, stream=None):
        (stream if stream is not None else current_stream()).wait_event(self)

    def synchronize(self):
        _compute_waits(self.works)

    def query(self):
        return True

    def elapsed_time(self, end_event):
        """Milliseconds of virtual time from this event to `end_event` (torch's unit)."""
        if self.clock_ns is None or end_event.clock_ns is None:
            raise RuntimeError(
                "podsim: elapsed_time needs two events created with enable_timing=True and "
                "recorded (as torch.cuda.Event requires)")
        return (end_event.clock_ns - self.clock_ns) / 1e6


def _clock_ns():
    """The chip's clock where the rank's compute stream is now (a round trip carrying the
    compute run since the previous request); 0 before the rank has a process group."""
    from . import torch as backend

    rank = backend._rank
    if rank is None or rank.done:
        return 0.0
    rank.call({"op": "clock"})
    return rank.clock_ns


class Stream:
    """A stream of the rank's device: the default one is the compute stream."""

    def __init__(self, device=None, priority=0, **_):
        self._pending = []
        self.priority = priority

    @property
    def device(self):
        """The device the program believes it is on (`torch.cuda.Stream.device`): the
        accelerator of its local rank."""
        import torch

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def device_index(self):
        return self.device.index

    @property
    def device_type(self):
        return self.device.type

    def outstanding(self):
        """The collectives issued on (or made to wait on) this stream not yet waited for."""
        self._pending = [w for w in self._pending if w not in _done]
        return tuple(self._pending)

    def add(self, works):
        self._pending.extend(w for w in works if w not in _done)

    def wait_event(self, event):
        if event is None:
            return
        if self is _DEFAULT:
            _compute_waits(event.works)
        else:  # this stream's later work follows those collectives
            self.add(event.works)

    def wait_stream(self, stream):
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self):
        _compute_waits(self.outstanding())

    def query(self):
        return True

    def is_capturing(self):
        return False  # no CUDA graphs on podsim's device

    def __enter__(self):
        self._previous = current_stream()
        set_stream(self)
        return self

    def __exit__(self, *exc):
        set_stream(self._previous)

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


_DEFAULT = Stream()
# Collectives the compute stream has waited for (their ids).
_done = set()
# Every collective issued and not yet waited for by the compute stream.
_issued = []


def current_stream(device=None):
    return getattr(_local, "stream", _DEFAULT)


def default_stream(device=None):
    return _DEFAULT


def set_stream(stream):
    _local.stream = stream


@contextlib.contextmanager
def stream(s):
    if s is None:
        yield
        return
    previous = current_stream()
    set_stream(s)
    try:
        yield
    finally:
        set_stream(previous)


def synchronize(device=None):
    """The host waits for everything issued."""
    _compute_waits(tuple(_issued))


def issued(work):
    """A collective was issued now: it runs on the chip from here, on the current stream (in
    the `strict` and `debug` eager modes it is waited for at once: nothing overlaps)."""
    _issued.append(work)
    for works in _recordings:
        works.append(work)
    current_stream().add((work,))
    if _SYNC:
        _compute_waits((work,))


@contextlib.contextmanager
def recording():
    """The collectives issued inside, collected in a list (what a DDP comm hook issues for
    its bucket, `podsim._meta_ddp`)."""
    works = []
    _recordings.append(works)
    try:
        yield works
    finally:
        _recordings.remove(works)


_recordings = []


def waited(work):
    """`work.wait()`: the compute stream waits for it when it is current; another stream
    makes its later work wait."""
    s = current_stream()
    if s is _DEFAULT:
        _compute_waits((work,))
    else:
        s.add((work,))


def wait_all():
    _compute_waits(tuple(_issued))


def _compute_waits(works):
    works = [w for w in works if w not in _done]
    if not works:
        return
    _done.update(works)
    _issued[:] = [w for w in _issued if w not in _done]
    from . import torch as backend

    rank = backend._rank
    if rank is not None:
        rank.wait_for(works)


class Handle:
    """A device handle (as `torch.cuda` is one) whose streams are these; everything else is
    the CPU's."""

    Stream = Stream
    Event = Event

    def __getattr__(self, name):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def current_stream(device=None):
        return current_stream()

    @staticmethod
    def default_stream(device=None):
        return _DEFAULT

    @staticmethod
    def stream(s):
        return stream(s)

    @staticmethod
    def set_stream(s):
        set_stream(s)

    @staticmethod
    def synchronize(device=None):
        synchronize()

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def is_available():
        return True


HANDLE = Handle()
