"""The rank server and its stub (`podsim/_prefork.py`, `programs/src/torch/stub.py`) without a
podsim binary: a forked rank runs the program as `python ARGS` would - its arguments,
environment, directory, streams and exit, a signal included - and dies with its stub."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = os.path.join(os.path.dirname(PACKAGE), "programs", "src", "torch", "stub.py")

PROGRAM = """import os, sys
print("args", sys.argv, "rank", os.environ.get("RANK"), "cwd", os.getcwd(), "name", __name__,
      "path0", sys.path[0], "pgid", os.getpgrp(), flush=True)
sys.stderr.write("to stderr\\n")
what = sys.argv[1] if len(sys.argv) > 1 else "0"
if what == "raise":
    raise RuntimeError("the program gives up")
if what == "term":
    os.kill(os.getpid(), 15)
if what == "sleep":
    import time
    time.sleep(60)
sys.exit(int(what))
"""


class RankServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="podsim-prefork-")
        cls.program = os.path.join(cls.dir, "program.py")
        with open(cls.program, "w") as f:
            f.write(PROGRAM)
        # A server as a harness holds one (`python -m podsim.rank_server`, serving until its
        # input ends): a job's own server is the same loop, named by the worker instead.
        env = dict(os.environ, PYTHONPATH=PACKAGE)
        env.pop("PODSIM_RANK_SERVER", None)
        cls.server = subprocess.Popen(
            [sys.executable, "-m", "podsim.rank_server"], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = cls.server.stdout.readline().strip()
        cls.socket = line.partition("PODSIM_RANK_SERVER=")[2]
        assert cls.socket.startswith("podsim-rank-server-"), line
        with open(STUB) as f:
            cls.stub = f.read()

    @classmethod
    def tearDownClass(cls):
        # Its input's end ends it, with status 0.
        cls.server.stdin.close()
        try:
            code = cls.server.wait(timeout=30)
        finally:
            cls.server.kill()
            cls.server.wait()
            cls.server.stdout.close()
            cls.server.stderr.close()
            shutil.rmtree(cls.dir, ignore_errors=True)
        assert code == 0, f"the server exited {code} when its input ended"

    def start(self, *args, rank="3"):
        env = dict(os.environ, PYTHONPATH=PACKAGE, PODSIM_PREFORK_SOCKET=self.socket, RANK=rank)
        return subprocess.Popen(
            [sys.executable, "-S", "-c", self.stub, *args], env=env, cwd=self.dir,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            process_group=0,
        )

    def run_stub(self, *args, rank="3"):
        p = self.start(*args, rank=rank)
        out, err = p.communicate(timeout=60)
        return p.returncode, out, err, p.pid

    def test_the_program_gets_the_stubs_arguments_environment_directory_and_streams(self):
        code, out, err, pid = self.run_stub(self.program, "7", rank="5")
        self.assertEqual(code, 7, err)
        self.assertIn(f"args ['{self.program}', '7'] rank 5 cwd {self.dir} name __main__", out)
        self.assertIn(f"path0 {self.dir} pgid {pid}", out)  # in the stub's process group
        self.assertEqual(err, "to stderr\n")

    def test_an_exception_is_exit_1_with_the_programs_traceback_alone(self):
        code, _, err, _ = self.run_stub(self.program, "raise")
        self.assertEqual(code, 1)
        self.assertIn("RuntimeError: the program gives up", err)
        self.assertNotIn("runpy", err)
        self.assertNotIn("_prefork", err)

    def test_a_signal_that_ends_the_program_ends_the_stub(self):
        code, _, _, _ = self.run_stub(self.program, "term")
        self.assertEqual(code, -signal.SIGTERM)

    def test_module_and_code_forms(self):
        code, out, _, _ = self.run_stub("-c", "import sys; print(__name__, sys.argv)", "x")
        self.assertEqual((code, out.strip()), (0, "__main__ ['-c', 'x']"))
        code, out, _, _ = self.run_stub("-m", "json.tool", "--help")
        self.assertEqual(code, 0)
        self.assertIn("usage", out)

    def test_exit_runs_threads_and_exit_handlers_and_flushes_as_python_does(self):
        program = (
            "import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('exit handler ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "sys.stdout.write('unflushed')\n"
            "sys.exit('a message')\n"
        )
        code, out, err, _ = self.run_stub("-c", program)
        self.assertEqual(code, 1)  # a text exit code is 1, the text on stderr
        self.assertEqual(err.strip(), "a message")
        self.assertEqual(out.split(), ["unflushedthread", "done", "exit", "handler", "ran"])

    def test_a_killed_stub_takes_its_rank_with_it(self):
        p = self.start(self.program, "sleep")
        pid = None
        deadline = time.monotonic() + 30
        while pid is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if line.startswith("args"):
                pid = p.pid
        self.assertIsNotNone(pid, "the rank did not start")
        rank = [int(x) for x in os.listdir("/proc") if x.isdigit() and _pgid(int(x)) == p.pid
                and int(x) != p.pid]
        self.assertEqual(len(rank), 1, rank)
        p.kill()
        p.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(rank[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(_alive(rank[0]), "the forked rank outlived its stub")

    def test_a_server_gone_mid_conversation_ends_the_stub_as_its_rank_died(self):
        # A server that takes the stub's request and ends without a word (killed, its
        # forked rank killed with it): the stub dies by SIGKILL, as the rank did, saying why;
        # an exit code would read as the program's own failure.
        import socket
        name = f"podsim-test-gone-{os.getpid()}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + name)
        listener.listen(1)
        env = dict(os.environ, PODSIM_PREFORK_SOCKET=name, RANK="0")
        p = subprocess.Popen([sys.executable, "-S", "-c", self.stub, "-c", "pass"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            listener.settimeout(30)
            conn, _ = listener.accept()
            conn.recv(1 << 16)
            conn.close()
            _, err = p.communicate(timeout=30)
        finally:
            p.kill()
            p.wait()
            listener.close()
        self.assertEqual(p.returncode, -signal.SIGKILL)
        self.assertIn("the rank server ended before this rank did", err)


    # What a server runs is what it imported: a stub of another interpreter or another
    # `PYTHONPATH` is refused, saying why; the job's own environment reaches podsim's boot.

    def test_another_pythonpath_is_refused_saying_why(self):
        env = dict(os.environ, PYTHONPATH=self.dir, PODSIM_PREFORK_SOCKET=self.socket)
        p = subprocess.run([sys.executable, "-S", "-c", self.stub, self.program, "0"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("the rank server refused this rank", p.stderr)
        self.assertIn(f"PYTHONPATH {self.dir}", p.stderr)

    def test_a_boot_folder_is_not_another_path_and_the_job_reaches_the_boot(self):
        boot = os.path.join(self.dir, "podsim-boot-1-2")
        program = ("import os, torch, podsim._intercept as i\n"
                   "print(i._installed, i.mode(), torch.get_num_threads(), os.environ['PODSIM_BOOTED'])")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([boot, PACKAGE]),
                   PODSIM_PREFORK_SOCKET=self.socket, PODSIM_MODE="meta", OMP_NUM_THREADS="1")
        p = subprocess.run([sys.executable, "-S", "-c", self.stub, "-c", program], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual((p.returncode, p.stdout.strip()), (0, "True meta 1 1"), p.stderr)


class Shared(unittest.TestCase):
    """`python -m podsim.rank_server COMMAND`: one server for the jobs of a command (the
    server `RankServer` uses is one held by its standard input)."""

    def test_a_command_runs_with_the_server_named_and_ends_it_with_its_status(self):
        env = dict(os.environ, PYTHONPATH=PACKAGE)
        env.pop("PODSIM_RANK_SERVER", None)
        with open(STUB) as f:
            stub = f.read()
        # The command runs a rank through the server it names - `-m` a module of the rank's
        # own directory, which `python -m` finds there whatever directory the server started
        # in - then exits 3.
        ranks_dir = tempfile.mkdtemp(prefix="podsim-shared-")
        self.addCleanup(shutil.rmtree, ranks_dir, True)
        with open(os.path.join(ranks_dir, "rankmod.py"), "w") as f:
            f.write("import os, sys\nprint('rank in', sys.path[0], os.getppid() != 1)\n")
        command = ("import os, subprocess, sys\n"
                   "env = dict(os.environ, PODSIM_PREFORK_SOCKET=os.environ['PODSIM_RANK_SERVER'])\n"
                   f"p = subprocess.run([sys.executable, '-S', '-c', {stub!r}, '-m', 'rankmod'], "
                   f"env=env, cwd={ranks_dir!r})\n"
                   "sys.exit(3 if p.returncode == 0 else 9)")
        p = subprocess.run([sys.executable, "-m", "podsim.rank_server", sys.executable, "-c",
                            command], env=env, capture_output=True, text=True, timeout=120,
                           cwd=PACKAGE)
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn(f"rank in {ranks_dir} True", p.stdout)


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    unittest.main()
