"""The rank server of a job: one process imports torch and podsim's interceptions once, then
forks a rank for each chip, so that eight ranks on two cores do not each spend 3-4 s of CPU
importing torch (`programs/src/torch/ranks.rs` starts it, when the job's command is a Python
script run with podsim's interceptions).

The worker still starts one process per rank - a stub (`python -S -c STUB ARGS`, no `site`, so
it starts in milliseconds; `programs/src/torch/stub.py`) - and watches, kills and reaps that
process as it would the rank. The stub connects here and sends its standard streams (as file
descriptors), its arguments, environment, working directory and process group. The server
forks a child that takes them all - it joins the stub's process group, so that killing the
rank's group kills it - and runs the program as `python ARGS` would. The server tells the stub
the child's exit, and the stub exits the same way. A stub that goes away takes its child with
it; the server and its children die with the worker (their parent-death signal).

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

# The stub's request: a 4-byte length, then that many bytes of JSON (the first part arrives
# with its file descriptors).
_LENGTH = struct.Struct("!I")
_MAX_REQUEST = 1 << 22
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def serve() -> None:
    """Serves the stubs until the worker kills this process (or it dies with the worker)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + os.environ["PODSIM_PREFORK_SOCKET"])
    listener.listen(1024)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    stub_of = {}  # child pid -> its stub's connection
    child_of = {}  # a stub's connection -> its child's pid
    _preload()
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request, fds = _read_request(conn)
                if request is None:
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    # Never returns: the program's own exit ends this process.
                    _become(request, fds, [listener, conn, *child_of], selector, wake_read, wake_write)
                for fd in fds:
                    os.close(fd)
                stub_of[pid], child_of[conn] = conn, pid
                selector.register(conn, selectors.EVENT_READ)
                _send(conn, f"pid {pid}\n")
            elif key.fileobj == wake_read:
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
            else:
                # A stub says nothing after its request: readable means it went away.
                conn = key.fileobj
                selector.unregister(conn)
                pid = child_of.pop(conn)
                stub_of.pop(pid, None)
                conn.close()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _reap(stub_of, child_of, selector)


def _preload():
    """Loads, once for every rank, what distributed programs load after their start: DDP,
    FSDP2 and device meshes each import torch's compiler front end (`torch._dynamo`, 2 s of
    CPU), which eight ranks on two cores would otherwise import eight times. A program that
    never needs it costs the server those 2 s, once. Nothing here may start a thread (see the
    module doc): importing it starts none."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # a rank that needs it fails on its own, saying why
        sys.stderr.write(f"podsim rank server: could not preload torch._dynamo: {e}\n")


def _reap(stub_of, child_of, selector):
    """Tells each ended child's stub how it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
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
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
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
        args = list(request["args"])
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    try:
        _run_program(args)
    except SystemExit as e:
        _exit_forked(e.code)


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
