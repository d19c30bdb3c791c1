"""The rank server: one process imports torch once, then forks a rank for each chip, so that
eight ranks on two cores do not each spend 3-4 s of CPU importing torch
(`programs/src/torch/ranks.rs` starts one per job, when the job's command is a Python script
run with podsim's interceptions; `python -m podsim.rank_server` starts one that many jobs
share).

The worker still starts one process per rank - a stub (`python -S -c STUB ARGS`, no `site`, so
it starts in milliseconds; `programs/src/torch/stub.py`) - and watches, kills and reaps that
process as it would the rank. The stub connects here and sends its standard streams (as file
descriptors), its interpreter, arguments, environment, working directory and process group.
The server forks a child that takes them all - it joins the stub's process group, so that
killing the rank's group kills it - then loads podsim's interceptions for the job's
environment (meta mode or not, the chip's HBM: nothing of the job is loaded before the fork,
which is what lets one server serve many jobs) and runs the program as `python ARGS` would.
The server tells the stub the child's exit, and the stub exits the same way. A stub that goes
away takes its child with it; the children die with the server (their parent-death signal),
and a job's server with its worker.

A stub is served only by a server of the same user, the same interpreter and the same
`PYTHONPATH` (podsim's boot folder aside): a child runs what the server imported, so anything
else would run the program on another torch or another podsim than the job names.

Single-threaded on purpose: a fork copies only the thread that calls it, and a lock another
thread held at that moment would stay held in the child for ever."""

import ctypes
import json
import os
import selectors
import signal
import socket
import struct
import sys
from typing import List, Optional

# The stub's request: a 4-byte length, then that many bytes of JSON (the first part arrives
# with its file descriptors).
_LENGTH = struct.Struct("!I")
_MAX_REQUEST = 1 << 22
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# The server's own OMP_NUM_THREADS when it loaded torch: a child whose job says otherwise
# sets its own thread count.
_SERVER_THREADS: Optional[str] = None


class _Server:
    """The server's state: its socket, the stubs it serves and their children, and what ends
    it (its worker's death, its standard input's end, or its command's exit)."""

    def __init__(self, name: str, watch_stdin: bool) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + name)
        self.listener.listen(1024)
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_read, selectors.EVENT_READ)
        if watch_stdin:
            self.selector.register(0, selectors.EVENT_READ)
        self.stub_of: dict = {}  # child pid -> its stub's connection
        self.child_of: dict = {}  # a stub's connection -> its child's pid
        self.command = None  # the command this server was started for, once started
        self.ended = None  # its exit status, or -1 once standard input has ended
        # What every child runs: this interpreter and what it imported from this path.
        self.identity = _identity(sys.executable, os.environ)

    def step(self) -> None:
        """Handles what is ready: a stub's request, a signal, a stub gone, input's end."""
        for key, _ in self.selector.select():
            if key.fileobj is self.listener:
                self._accept()
            elif key.fileobj == self.wake_read:
                _drain(self.wake_read)
            elif key.fileobj == 0:
                if not os.read(0, 512):
                    self.ended = -1
            else:
                # A stub says nothing after its request: readable means it went away.
                conn = key.fileobj
                self.selector.unregister(conn)
                pid = self.child_of.pop(conn)
                self.stub_of.pop(pid, None)
                conn.close()
                _kill(pid)
        status = _reap(self.stub_of, self.child_of, self.selector, self.command)
        if status is not None:
            self.ended = status

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        request, fds = _read_request(conn)
        refusal = request is not None and _refusal(request, self.identity)
        if request is None or refusal:
            if refusal:
                _send(conn, f"refused {refusal}\n")
            for fd in fds:
                os.close(fd)  # the stub's streams: held, they would outlive it
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            # Never returns: the program's own exit ends this process.
            _become(request, fds, [self.listener, conn, *self.child_of], self.selector,
                    self.wake_read, self.wake_write)
        for fd in fds:
            os.close(fd)
        self.stub_of[pid], self.child_of[conn] = conn, pid
        self.selector.register(conn, selectors.EVENT_READ)
        _send(conn, f"pid {pid}\n")

    def close(self) -> None:
        """Ends every rank still running (their stubs then say the server ended)."""
        for pid in list(self.stub_of):
            _kill(pid)
        self.listener.close()


def serve(name: Optional[str] = None, announce: Optional[str] = "ready",
          watch_stdin: bool = False, command: Optional[List[str]] = None) -> int:
    """Serves stubs at the abstract socket `name` (the worker's `PODSIM_PREFORK_SOCKET` when
    none is given), printing `announce` once torch is loaded. A job's server serves until its
    worker kills it (or dies: its parent-death signal); with `watch_stdin`, until its
    standard input ends; with a `command`, until that command - started with
    `PODSIM_RANK_SERVER` naming this server - exits, whose status it then returns."""
    name = name or os.environ["PODSIM_PREFORK_SOCKET"]
    server = _Server(name, watch_stdin)
    _preload()
    if announce is not None:
        print(announce, flush=True)
    if command:
        import subprocess

        env = dict(os.environ, PODSIM_RANK_SERVER=name)
        env.pop("PODSIM_BOOTED", None)
        try:
            server.command = subprocess.Popen(command, env=env)
        except OSError as e:
            sys.stderr.write(f"podsim rank server: cannot run {command[0]}: {e}\n")
            server.close()
            return 127
    while server.ended is None:
        server.step()
    server.close()
    return max(server.ended, 0)


def _preload() -> None:
    """Loads, once for every rank, what distributed programs load after their start: torch,
    and the compiler front end (`torch._dynamo`, 2 s of CPU) that DDP, FSDP2 and device
    meshes import, which eight ranks on two cores would otherwise import eight times. A
    program that never needs it costs the server those 2 s, once. Nothing of a job is
    loaded (podsim's interceptions read the job's environment: each child loads them), and
    nothing here may start a thread (see the module doc): importing these starts none."""
    global _SERVER_THREADS
    _SERVER_THREADS = os.environ.get("OMP_NUM_THREADS")
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # a rank that needs it fails on its own, saying why
        sys.stderr.write(f"podsim rank server: could not preload torch._dynamo: {e}\n")


def _identity(python: str, env) -> tuple:
    """What a rank's process would load: its interpreter and its `PYTHONPATH`, without the
    job's own boot folder (`programs/src/torch/boot.rs`), which every job names anew."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and not os.path.basename(os.path.normpath(p)).startswith("podsim-boot-")]
    return os.path.abspath(python), paths


def _refusal(request, identity) -> Optional[str]:
    """Why this server cannot run the stub's rank, or None when it can."""
    theirs = _identity(str(request.get("python", "")), request.get("env", {}))
    if theirs == identity:
        return None
    return (f"this rank runs {theirs[0]} with PYTHONPATH {os.pathsep.join(theirs[1]) or '(none)'}, "
            f"the rank server {identity[0]} with {os.pathsep.join(identity[1]) or '(none)'}: "
            "start the rank server from the job's environment, or unset PODSIM_RANK_SERVER")


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 512):
                return
        except BlockingIOError:
            return


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(stub_of, child_of, selector, command) -> Optional[int]:
    """Tells each ended child's stub how it ended; the `command`'s exit status once it has
    ended (it is a child too), else None."""
    ended = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        if command is not None and pid == command.pid:
            command.returncode = os.waitstatus_to_exitcode(status)
            ended = command.returncode if command.returncode >= 0 else 128 - command.returncode
            continue
        conn = stub_of.pop(pid, None)
        if conn is None:
            continue
        child_of.pop(conn, None)
        selector.unregister(conn)
        if os.WIFSIGNALED(status):
            _send(conn, f"signal {os.WTERMSIG(status)}\n")
        else:
            _send(conn, f"exit {os.waitstatus_to_exitcode(status)}\n")
        conn.close()


def _send(conn, text):
    try:
        conn.sendall(text.encode())
    except OSError:
        pass  # the stub is gone; its child is killed when its end is seen


def _read_request(conn):
    """The stub's request and its three descriptors, or (None, []) for anything else."""
    conn.settimeout(10)
    fds = []
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        uid = struct.unpack("3i", creds)[1]
        if uid != os.getuid():
            raise ValueError(f"a process of user {uid}, not this server's {os.getuid()}")
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if not data and not fds:
            return None, []  # connected and went away: a worker seeing that the server is up
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors, not 3")
        while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
            if len(data) > _MAX_REQUEST:
                raise ValueError("a request over 4 MiB")
            more = conn.recv(1 << 16)
            if not more:
                raise ValueError("the stub went away mid-request")
            data += more
        (length,) = _LENGTH.unpack_from(data)
        request = json.loads(data[_LENGTH.size:_LENGTH.size + length])
        conn.settimeout(None)
        return request, fds
    except (OSError, ValueError) as e:
        for fd in fds:
            os.close(fd)
        sys.stderr.write(f"podsim rank server: refused a stub's request: {e}\n")
        return None, []


def _become(request, fds, sockets, selector, *pipe):
    """In the forked child: takes the stub's place (its group, streams, environment,
    directory, arguments) and runs the program; the program's exit (or exception) ends the
    process as it would end `python ARGS`."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        for s in sockets:
            s.close()
        for fd in pipe:
            os.close(fd)
        server = os.getppid()
        os.setpgid(0, int(request["pgid"]))
        # The rank dies with the server, as the stub with the worker (set before anything
        # else runs; the server may have died between the fork and here).
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server:
            os._exit(1)
        # `ps` and `top` show the rank, not the server's command line it was forked with.
        rank = request["env"].get("RANK", "?")
        prctl(_PR_SET_NAME, f"podsim-rank{rank}".encode()[:15], 0, 0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        env = dict(request["env"])
        env["PODSIM_BOOTED"] = "1"  # what the program starts skips podsim's boot, as usual
        os.environ.clear()
        os.environ.update(env)
        if "random" in sys.modules:
            sys.modules["random"].seed()  # each rank its own, as separate processes would be
        _threads(env.get("OMP_NUM_THREADS"))
        args = list(request["args"])
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    # podsim's interceptions, for this job (as the rank's sitecustomize.py loads them in a
    # rank that starts its own interpreter).
    from . import _intercept

    _intercept.boot()
    try:
        _run_program(args)
    except SystemExit as e:
        _exit_forked(e.code)


def _threads(wanted: Optional[str]) -> None:
    """The job's intra-op threads (`OMP_NUM_THREADS`, one per rank when ranks share the host),
    where the server loaded torch with another count: OpenMP read it then, not now."""
    if wanted == _SERVER_THREADS:
        return
    try:
        count = int(wanted) if wanted else len(os.sched_getaffinity(0))
    except ValueError:
        return  # as OpenMP ignores a count it cannot read
    if count > 0:
        import torch

        torch.set_num_threads(count)


def _exit_forked(code):
    """Ends a forked rank as `python` would end - its non-daemon threads joined, its `atexit`
    handlers run, its streams flushed - but without the C++ static destructors of the state
    it inherited from the server: those would destroy thread objects of threads that exist
    only in the server (a joinable `std::thread` destroyed aborts the process, as a forked
    FSDP2 rank once did at its exit). `multiprocessing` ends its forked children the same
    way."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    try:
        import threading

        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


def _run_program(args):
    """`python ARGS` in this process: a script, `-m module` or `-c code`."""
    import runpy

    try:
        if args[:1] == ["-m"] and len(args) >= 2:
            sys.argv = args[1:]
            # As `python -m` does: the rank's directory first (a shared server's own start
            # directory otherwise stays there).
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[:1] == ["-c"] and len(args) >= 2:
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        intercept = sys.modules.get("podsim._intercept")
        if intercept is not None:
            intercept.exited(e)
        raise
    except BaseException as e:
        # As `python ARGS` shows it: from the program's first frame, without runpy's.
        tb = e.__traceback__
        while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
            tb = tb.tb_next
        if tb is not None:
            e.__traceback__ = tb  # what the default hook prints, whatever it is passed
        sys.excepthook(type(e), e, e.__traceback__)
        raise SystemExit(1)
    raise SystemExit(0)
