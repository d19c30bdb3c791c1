#!/usr/bin/env python3
"""The PyTorch backend's end-to-end tests: user scripts under `podsim run` against the same
scripts under `torchrun` with gloo, and fault tests with Python ranks.

Run with the Python of the environment `scripts/python_env.sh` prints (torch and podsim's
package installed):  python scripts/torch_tests.py --podsim target/debug/podsim
Each case prints one line; the exit code is the number of failed cases.
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples", "torch")
# Every command is bounded: a hang here fails the case instead of the suite.
DEADLINE_S = 600
# torchrun's results, kept between runs outside the working tree (beside the torch
# environment): the same scripts under the same torch on the same machine give the same
# values, and rerunning them took a third of these tests' time.
REFS = os.environ.get(
    "PODSIM_TORCH_REFS", os.path.join(os.path.expanduser("~"), ".cache", "podsim", "torch-refs"))


def run(cmd, env=None):
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S, env=env, cwd=REPO)
    return p, time.perf_counter() - start


def podsim_run(args, topology, script, *script_args, extra_env=None, flags=()):
    out = tempfile.mkdtemp(prefix="podsim-torch-")
    env = dict(os.environ, **(extra_env or {}))
    cmd = [args.podsim, "run", "--topology", topology, *flags, "--out", out, "--",
           sys.executable, os.path.join(EXAMPLES, script), *script_args]
    p, wall = run(cmd, env)
    report = None
    path = os.path.join(out, "report.json")
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
    return p, wall, report


def torchrun(nproc, script, *script_args):
    # `--standalone`: its rendezvous on a free port of this host. Without it torchrun takes
    # 29500, and two references made at once (cases run two at a time) fail each other.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), os.path.join(EXAMPLES, script), *script_args]
    return run(cmd)


def example_closure(script):
    """`script` and every example module it imports, directly or through another (by
    `ast`): what its result can depend on among the examples."""
    import ast

    seen, todo = set(), [script]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        with open(os.path.join(EXAMPLES, name), "rb") as f:
            tree = ast.parse(f.read(), name)
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            todo += [m + ".py" for m in modules if os.path.exists(os.path.join(EXAMPLES, m + ".py"))]
    return sorted(seen)


def reference_key(case, nproc):
    """What a torchrun result depends on: the case's script and the example modules it
    imports (not the other examples: a new fault in faults.py keeps ddp.py's result), the
    case, torch's and Python's versions and the machine's core count (torch's threads)."""
    import torch

    script = case if isinstance(case, str) else case[0]
    h = hashlib.sha256()
    for name in example_closure(script):
        h.update(name.encode())
        with open(os.path.join(EXAMPLES, name), "rb") as f:
            h.update(f.read())
    h.update(repr((case, nproc, torch.__version__, sys.version, os.cpu_count())).encode())
    return h.hexdigest()[:16]


def gloo_reference(args, script, nproc, out, script_args=()):
    """torchrun's result of `script` at `out` (and `out.rankN` where the script writes them):
    from the cache when the same case ran before, else run and kept. Returns (error or None,
    torchrun's wall seconds, its steps/s, whether it came from the cache)."""
    key = reference_key((script, *script_args) if script_args else script, nproc)
    cached = os.path.join(REFS, f"{script}-{nproc}-{key}")
    meta_path = os.path.join(cached, "meta.json")
    if not args.fresh_references and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        for name in meta["files"]:
            shutil.copy(os.path.join(cached, name), os.path.join(os.path.dirname(out), name))
        return None, meta["wall_s"], meta["steps_per_s"], True
    g, gwall = torchrun(nproc, script, *script_args, "--out", out)
    if g.returncode != 0:
        # The reference is not what is under test, and gloo's CPU transport aborts a rank
        # now and then on a loaded 2-core host (SIGABRT in one rank, SIGTERM to the rest):
        # one more try before the case fails.
        print(f"torchrun reference of {script} exited {g.returncode}; running it again",
              flush=True)
        g, gwall = torchrun(nproc, script, *script_args, "--out", out)
    if g.returncode != 0:
        return f"torchrun exited {g.returncode}: {g.stderr[-600:]}", gwall, None, False
    base = os.path.basename(out)
    files = sorted(n for n in os.listdir(os.path.dirname(out))
                   if n == base or n.startswith(base + ".rank"))
    meta = {"files": files, "wall_s": gwall, "steps_per_s": steps_per_s(g.stdout)}
    # Kept whole or not at all: written aside, then renamed into place.
    os.makedirs(REFS, exist_ok=True)
    staging = tempfile.mkdtemp(prefix="staging-", dir=REFS)
    for name in files:
        shutil.copy(os.path.join(os.path.dirname(out), name), os.path.join(staging, name))
    with open(os.path.join(staging, "meta.json"), "w") as f:
        json.dump(meta, f)
    shutil.rmtree(cached, ignore_errors=True)
    os.replace(staging, cached)
    return None, gwall, meta["steps_per_s"], False


def compare(a_path, b_path):
    """Largest relative difference (per tensor, by norm) between two saved dicts."""
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    if set(a) != set(b):
        return float("inf"), f"different keys: {sorted(set(a) ^ set(b))[:5]}"
    worst, name = 0.0, f"all {len(a)} tensors equal bit for bit"
    for k in a:
        diff = (a[k].double() - b[k].double()).norm().item()
        scale = max(b[k].double().norm().item(), 1e-30)
        if diff / scale > worst:
            worst, name = diff / scale, k
    return worst, name


def steps_per_s(text):
    m = re.findall(r"([0-9.]+) steps/s", text)
    return float(m[-1]) if m else None


# How far a bf16 program's trained parameters may be from torchrun + gloo's. podsim sums a
# reduction in its torus algorithm's order, gloo in its ring's (chunk k from rank k-1 down to
# k): f32 sums that differ in their last bit, which bf16 parameters and activations round apart
# (2^-8 relative) and three steps carry on: the llama's differ by up to 2.1e-4 after 3 steps at
# 8 ranks (1.1e-4 at 4; bit for bit on some hosts), where f32 programs stay within 3e-7.
# Gradients that differ show far above it: the same llama trained on half the batch per rank
# ends 4 % away (the largest tensor's difference, 4 ranks).
BF16_TOL = 1e-3


def case_same_as_gloo(args, script, topology, tol=1e-6, script_args=()):
    tmp = tempfile.mkdtemp(prefix="podsim-torch-")
    mine, theirs = os.path.join(tmp, "podsim.pt"), os.path.join(tmp, "gloo.pt")
    p, wall, report = podsim_run(args, topology, script, *script_args, "--out", mine)
    if p.returncode != 0:
        return False, f"podsim run exited {p.returncode}: {p.stdout[-600:]}{p.stderr[-600:]}"
    failed, gwall, gloos, cached = gloo_reference(args, script, 8, theirs, script_args)
    if failed:
        return False, failed
    worst, name = compare(mine, theirs)
    ok = worst <= tol
    extra = ""
    if os.path.exists(mine + ".rank0"):
        for r in range(8):
            w, n = compare(f"{mine}.rank{r}", f"{theirs}.rank{r}")
            ok = ok and w <= tol
            worst = max(worst, w)
        extra = ", every rank's local shards too"
    ours = steps_per_s(p.stdout)
    speed = f"; {ours} steps/s vs gloo {gloos}" if ours and gloos else ""
    steps = len(((report or {}).get("torch") or {}).get("steps", []))
    source = " (its result kept from an earlier run)" if cached else ""
    return ok, (f"max relative difference {worst:.2e} ({name}){extra}; {steps} steps in the "
                f"report; wall {wall:.1f} s vs torchrun {gwall:.1f} s{source}{speed}")


def leftover(pattern):
    p = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()]


def descendants(pid):
    """Every live process below `pid` (by parent links in /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def case_killed_leaves_nothing(args, shared):
    """`podsim run` killed with SIGKILL while its ranks (forked by a rank server) sleep: the
    worker, the stubs and the forked ranks all go, and the job's own rank server; a shared
    one (`python -m podsim.rank_server`, whose children the ranks are) stays, serving."""
    out = tempfile.mkdtemp(prefix="podsim-torch-")
    program = "import torch.distributed as dist, time\ndist.init_process_group()\ntime.sleep(600)"
    env = dict(os.environ)
    if not shared:
        env.pop("PODSIM_RANK_SERVER", None)
    p = subprocess.Popen([args.podsim, "run", "--topology", "2x2", "--set", "job.prefork=true",
                          "--out", out, "--",
                          sys.executable, "-c", program],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    # The worker, the keeper, 4 stubs, and the job's rank server with the 4 ranks it forked
    # (a shared server's ranks are its children: those in the stubs' process groups).
    want = 6 if shared else 11
    deadline, below, forked = time.time() + 60, [], []
    while time.time() < deadline and (len(below) < want or len(forked) < 4):
        time.sleep(0.2)
        below = descendants(p.pid)
        groups = {pid for pid in below if _pgid(pid) == pid}
        # A forked rank keeps the server's command line; its name says what it is.
        forked = [pid for pid in os.listdir("/proc") if pid.isdigit()
                  and _comm(int(pid)).startswith("podsim-rank") and _pgid(int(pid)) in groups]
        forked = [int(pid) for pid in forked]
    server = [pid for pid in below if "_prefork.serve" in _cmdline(pid) and pid not in forked]
    p.kill()
    p.wait()
    watched = set(below) | set(forked)
    deadline = time.time() + 15
    while time.time() < deadline and any(_alive(pid) for pid in watched):
        time.sleep(0.1)
    left = [pid for pid in watched if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    shared_alive = not shared or args.shared_server.poll() is None
    ok = (len(below) >= want and len(server) == (0 if shared else 1) and len(forked) == 4
          and not left and shared_alive)
    return ok, (f"{len(below)} processes below podsim ({len(server)} rank server of its own, "
                f"{len(forked)} ranks forked), {len(left)} left after SIGKILL {left}"
                f"{'; the shared server serves on' if shared and shared_alive else ''}")


def case_shared_server_killed(args):
    """A shared rank server killed while a job's ranks sleep: the job fails at once as a dead
    worker whose rank says the server ended (not a hang), and nothing of it is left."""
    server = subprocess.Popen([sys.executable, "-m", "podsim.rank_server"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        name = server.stdout.readline().strip().partition("PODSIM_RANK_SERVER=")[2]
        out = tempfile.mkdtemp(prefix="podsim-torch-")
        program = "import torch.distributed as dist, time\ndist.init_process_group()\ntime.sleep(600)"
        p = subprocess.Popen([args.podsim, "run", "--topology", "2x2", "--out", out, "--",
                              sys.executable, "-c", program], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, PODSIM_RANK_SERVER=name))
        deadline, forked = time.time() + 60, []
        while time.time() < deadline and len(forked) < 4:
            time.sleep(0.2)
            forked = [pid for pid in descendants(server.pid) if _comm(pid).startswith("podsim-rank")]
        server.kill()
        killed = time.time()
        said, _ = p.communicate(timeout=60)
        took = time.time() - killed
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
        server.stdin.close()
    with open(os.path.join(out, "report.json")) as f:
        kind = (json.load(f).get("hang") or {}).get("kind")
    left = [pid for pid in forked if _alive(pid)]
    # Its stub dies as the forked rank did (SIGKILL), so a dead worker whenever the server
    # went: before, one killed before its rank connected exited 1 as a program error.
    ok = (len(forked) == 4 and (p.returncode, kind) == (3, "dead_worker")
          and not left and "the rank server ended before this rank did" in said)
    return ok, f"exit {p.returncode} {took:.1f} s after the kill, {kind}, {len(left)} ranks left"


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def case_fault(args, fault, rank, at, want_kind, want_exit, budget_ms):
    p, wall, report = podsim_run(args, "2x2x2", "faults.py", "--fault", fault, "--rank", str(rank),
                                 "--at", str(at))
    ended = time.time()
    fault_step = at
    hang = (report or {}).get("hang") or {}
    culprit = hang.get("culprit") or {}
    problems = []
    if p.returncode != want_exit:
        problems.append(f"exit {p.returncode}, want {want_exit}")
    if hang.get("kind") != want_kind:
        problems.append(f"kind {hang.get('kind')}, want {want_kind}")
    culprits = {"skip": None, "deadlock": {rank, rank ^ 1}}.get(fault, {rank})
    if culprits and culprit.get("chip") not in culprits:
        problems.append(f"culprit chip {culprit.get('chip')}, want one of {sorted(culprits)}")
    # From the fault to the diagnosis, two ways, each within the budget: the watchdog's own
    # (the report's detected_after_ms: from the culprit's last progress as its worker saw
    # it, or the fault event) and the user's, from the rank's own clock (it prints when it
    # goes wrong). The second took 3.6-4.7 s in 3 of about 40 runs while the first said
    # 2.1 s: the worker took the rank's stack sampler, waiting for a core, for the rank at
    # work, and restarted the stall's quiet time (mended 2026-11-26: the sampler names its
    # thread, which the worker leaves out).
    at = re.search(r"fault \w+ at ([0-9.]+)", p.stdout)
    detected = None
    if at and hang.get("detected_at_unix_ms"):
        detected = round(hang["detected_at_unix_ms"] - float(at.group(1)) * 1e3)
    own = hang.get("detected_after_ms")
    if own is None or own > budget_ms:
        problems.append(f"the watchdog took {own} ms from the fault's effect, budget {budget_ms}")
    if detected is None or detected > budget_ms:
        problems.append(f"detected {detected} ms after the rank's fault, budget {budget_ms}")
    exit_ms = round((ended - float(at.group(1))) * 1e3) if at else None
    if fault == "sleep":
        with open(os.path.join(EXAMPLES, "faults.py")) as f:
            line = next(i for i, l in enumerate(f, 1) if "time.sleep(3600)" in l)
        stack = culprit.get("python_stack") or []
        if not stack or f"faults.py:{line} " not in stack[-1]:
            problems.append(f"python stack ends {stack[-1:]} not at faults.py:{line}")
    if fault == "deadlock":
        with open(os.path.join(EXAMPLES, "faults.py")) as f:
            line = next(i for i, l in enumerate(f, 1) if "both receive first" in l)
        if "deadlock" not in hang.get("explanation", ""):
            problems.append("the diagnosis does not call it a deadlock")
        if f"faults.py:{line} " not in str(culprit.get("python_stack")):
            problems.append(f"python stack {culprit.get('python_stack')} not at faults.py:{line}")
    if fault == "skip" and f"Rank {rank} made its call at" not in hang.get("explanation", ""):
        problems.append(f"the desync does not name rank {rank}'s call")
    if fault in ("raise", "handled"):
        said = hang.get("explanation", "")
        error = "RuntimeError" if fault == "raise" else "ValueError"
        if error not in said or "faults.py:" not in said:
            problems.append(f"the error does not name the exception and its line: {said[:300]}")
        # The steps every rank made before one raised stay in the report: the failing rank's
        # and those of the ranks the failure stopped (each waits in the step after).
        ranks = ((report or {}).get("torch") or {}).get("ranks", [])
        made = {r["rank"]: len(r["steps"]) for r in ranks}
        if made != {r: fault_step for r in range(8)}:
            problems.append(f"torch section: steps by rank {made}, want {fault_step} for all 8")
    time.sleep(0.5)
    # This case's own stubs (a forked rank's command line is its server's): another case may
    # run beside it.
    left = leftover(f"examples/torch/faults.py --fault {fault} --rank {rank} ")
    if left:
        problems.append(f"processes left behind: {left}")
        for pid in left:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    detail = (f"{hang.get('kind')} on chip {culprit.get('chip')} {detected} ms after the fault "
              f"({own} ms by the watchdog's own measure; podsim exited after {exit_ms} ms): "
              f"{hang.get('explanation', '')[:400]}")
    return not problems, "; ".join(problems) or detail


def case_api(args, topology="2x2x2", flags=()):
    """Every supported call against values each rank computes itself."""
    p, wall, report = podsim_run(args, topology, "api.py", flags=flags)
    oks = p.stdout.count(": api ok")
    return p.returncode == 0 and oks == 8, f"{oks} of 8 ranks ok, exit {p.returncode}{'' if oks == 8 else ': ' + p.stdout[-800:]}"


def case_config_fault(args, program="ddp.py", chip=2):
    """podsim's own [[faults]] on a kind = "torch" job (configs/faults/torch_stall.toml, run
    with `program` and the stall moved to `chip`): the chip stalls at step 5."""
    out = tempfile.mkdtemp(prefix="podsim-torch-")
    with open(os.path.join(REPO, "configs", "faults", "torch_stall.toml")) as f:
        config = f.read()
    config = config.replace("examples/torch/ddp.py", f"examples/torch/{program}")
    config = re.sub(r"(?m)^chip = \d+$", f"chip = {chip}", config)
    path = os.path.join(out, "job.toml")
    with open(path, "w") as f:
        f.write(config)
    env = dict(os.environ, PODSIM_PYTHON=sys.executable)
    p, wall = run([args.podsim, "launch", path, "--out", out], env)
    with open(os.path.join(out, "report.json")) as f:
        hang = json.load(f).get("hang") or {}
    culprit = hang.get("culprit", {})
    ok = (p.returncode == 3 and hang.get("kind") == "stalled_chip"
          and culprit.get("chip") == chip and hang.get("detected_after_ms", 1e9) < 3000)
    return ok, (f"exit {p.returncode}, {hang.get('kind')} on chip {culprit.get('chip')} "
                f"after {hang.get('detected_after_ms')} ms, Python at {culprit.get('python_stack')}")


def case_meta_ddp(args):
    """A DDP program written for GPUs (nccl, cuda devices, `device_id`, `device_ids`) runs on
    podsim as is, a step per `optimizer.step()`; and meta mode runs DDP too (its C++ reducer
    stood in for, `podsim._meta_ddp`): the program, 4 MiB of parameters, issues in meta mode
    the collectives it issues in data mode - the same ops, calls and bytes (the shape check,
    the broadcast of rank 0's parameters, the buckets rebuilt after the first step, one
    all-reduce per bucket) - and from the second step its first bucket's all-reduce overlaps
    the rest of the backward."""
    runs = {}
    for mode in ("data", "meta"):
        p, wall, report = podsim_run(args, "2x2", "unedited_cuda.py", "--steps", "4",
                                     "--hidden", "1024", flags=["--mode", mode])
        torch_part = (report or {}).get("torch") or {}
        if p.returncode or not torch_part.get("ranks"):
            return False, f"{mode} mode: exit {p.returncode}: {p.stdout[-800:]}{p.stderr[-400:]}"
        runs[mode] = torch_part

    def calls(part):
        return [(c["op"], c["calls"], c["bytes"]) for c in part["ranks"][0]["collectives"]]

    steps = runs["meta"]["steps"]
    hidden = [s["comm_ms"] - s["exposed_comm_ms"] for s in steps]
    reduces = sum(c for op, c, _ in calls(runs["meta"]) if op == "all-reduce")
    ok = (calls(runs["data"]) == calls(runs["meta"]) and len(steps) == 4
          and len(runs["data"]["steps"]) == 4
          and len(runs["meta"]["ranks"]) == 1 and reduces == 1 + 2 * 3
          and hidden[0] < 1e-9 and all(h > 0 for h in hidden[1:]))
    return ok, (f"collectives data {calls(runs['data'])} vs meta {calls(runs['meta'])}; "
                f"{len(runs['meta']['ranks'])} process in meta mode; hidden communication "
                f"by step {[round(h, 5) for h in hidden]} ms")


def beside_every_rank(args, topology, *script_args, flags=()):
    """llama.py in meta mode on its representatives, and again with every rank a process
    (`job.symmetric=false`): the first run's process and report, each run's step times and
    process count, whether the step times are equal, and the walls; or the error."""
    flags = ["--mode", "meta", *flags]
    p, wall, rep = podsim_run(args, topology, "llama.py", *script_args, flags=flags)
    pe, wall_every, every = podsim_run(args, topology, "llama.py", *script_args,
                                       flags=flags + ["--set", "job.symmetric=false"])
    if p.returncode or pe.returncode:
        return None, f"exits {p.returncode}, {pe.returncode}: {p.stdout[-600:]}{pe.stdout[-600:]}"
    a = [s["virtual_ms"] for s in rep["torch"]["steps"]]
    b = [s["virtual_ms"] for s in every["torch"]["steps"]]
    run = {
        "process": p, "report": rep, "steps": (a, b),
        "processes": (len(rep["torch"]["ranks"]), len(every["torch"]["ranks"])),
        "same": len(a) == len(b) == 3 and all(abs(x - y) <= 1e-9 * max(y, 1e-9)
                                              for x, y in zip(a, b)),
        "said": (f"step ms {[round(x, 4) for x in a]} with {len(rep['torch']['ranks'])} "
                 f"processes vs {[round(x, 4) for x in b]} with {len(every['torch']['ranks'])}; "
                 f"wall {wall:.1f} s vs {wall_every:.1f} s"),
    }
    return run, None


def case_data_and_meta_alike(args):
    """The same program's step costs alike in data and meta mode (llama.py's debug model under
    FSDP2, 2x2x2): within 10 %. They were 40 % apart: in data mode, where the chip is the CPU,
    the profiler's markers, `.item()` and every sub-mesh's coordinate search were counted as
    kernels. What is left is the optimizer's step counts, which data mode keeps on the chip.
    Each step also says what of its compute waited for HBM beside FSDP2's collectives: never
    more than the compute, and some in meta mode."""
    steps, waits = {}, {}
    for mode in ("data", "meta"):
        p, _, report = podsim_run(args, "2x2x2", "llama.py", "--model", "debug", "--steps", "4",
                                  flags=["--mode", mode])
        if p.returncode != 0:
            return False, f"{mode} mode: exit {p.returncode}: {(p.stdout + p.stderr)[-300:]}"
        steps[mode] = report["torch"]["steps"][-1]["virtual_ms"]
        waits[mode] = [(s["hbm_wait_ms"], s["compute_ms"]) for s in report["torch"]["steps"]]
    ratio = steps["data"] / steps["meta"]
    waits_ok = all(0 <= w <= c for ws in waits.values() for w, c in ws)
    ok = abs(ratio - 1) <= 0.10 and waits_ok and waits["meta"][-1][0] > 0
    return ok, (f"last step {steps['data']:.4f} ms in data mode, "
                f"{steps['meta']:.4f} ms in meta mode: {ratio:.3f}; of its compute, "
                f"{waits['data'][-1][0]:.4f} / {waits['meta'][-1][0]:.4f} ms waited for HBM")


FSDP2_BLOCKS = """
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl")
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                        for _ in range(4)))
for block in model:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    model(torch.randn(2, 64, 1024, device="cuda")).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def case_data_and_meta_hbm_alike(args):
    """The same FSDP2 program's peak HBM alike in data and meta mode (within 10 %, its
    parameters within 10 %). Meta mode left out every buffer FSDP2 makes on its mesh's device
    (the unsharded parameters, the gathers' outputs), which is the meta device there: counted as
    a program's own meta tensors, nothing (meta 0.39 GiB against data's 0.45, parameters half).
    In both modes an open fused kernel kept alive what the program had freed (0.85 GiB against
    0.71 with reentrant checkpoints). Now about 5 % apart (248 and 236 MiB): torch runs AdamW's
    single-tensor loop on the CPU (data mode) and its foreach form on the meta device, as on an
    accelerator, and their temporaries differ."""
    return hbm_alike(args, FSDP2_BLOCKS)


# A DDP program of 16M float32 parameters (64 MiB), three steps.
DDP_BLOCKS = ("import torch, torch.nn as nn, torch.distributed as dist\n"
              "from torch.nn.parallel import DistributedDataParallel as DDP\n"
              "dist.init_process_group('nccl')\n"
              "m = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)]).cuda()\n"
              "d = DDP(m)\n"
              "opt = torch.optim.SGD(d.parameters(), lr=0.1)\n"
              "for step in range(3):\n"
              "    d(torch.randn(4, 2048, device='cuda')).sum().backward()\n"
              "    opt.step(); opt.zero_grad(set_to_none=False)\n")


def case_data_and_meta_ddp_hbm_alike(args):
    """A DDP program's peak HBM alike in data and meta mode: meta mode's reducer made its
    buckets with `device="meta"`, which podsim takes for the program's own meta tensors, so a
    gradient's size went uncounted (144 MiB against data's 208), and it held the old buckets
    while making the rebuilt ones (a gradient's size above data's)."""
    return hbm_alike(args, DDP_BLOCKS)


def hbm_alike(args, program):
    """`program`'s peak HBM, and its parameters', within 10 % in data and meta mode."""
    peaks = {}
    for mode in ("data", "meta"):
        p, _, report = run_inline(args, program, "--mode", mode, "--topology", "2x2")
        if p.returncode != 0 or not report:
            return False, f"{mode} mode: exit {p.returncode}: {(p.stdout + p.stderr)[-300:]}"
        step = max(report["torch"]["steps"], key=lambda s: s["peak_hbm_bytes"])
        peaks[mode] = (step["peak_hbm_bytes"], dict(step["hbm_by_kind"])["parameters"])
    (data, data_params), (meta, meta_params) = peaks["data"], peaks["meta"]
    ok = abs(meta / data - 1) <= 0.10 and abs(meta_params / data_params - 1) <= 0.10
    mib = 1 << 20
    return ok, (f"peak {data / mib:.1f} MiB in data mode (parameters {data_params / mib:.1f}), "
                f"{meta / mib:.1f} MiB in meta mode (parameters {meta_params / mib:.1f})")


def case_meta_representative(args):
    """Meta mode: one process standing for the 8 ranks of a 2x2x2 pod gives the virtual step
    times of 8 processes, one per rank; the report lists the values made up for `.item()`."""
    run, error = beside_every_rank(args, "2x2x2")
    if error:
        return False, error
    one = run["report"]
    stand_ins = sum(x[2] for r in one["torch"]["ranks"] for x in r.get("stand_ins", []))
    # llama.py checkpoints every block: MFU leaves the recomputed forward out, HFU keeps it.
    last = one["torch"]["steps"][-1]
    mfu, hfu = last.get("mfu", 0), last.get("hfu", 0)
    ok = (run["same"] and run["processes"] == (1, 8) and stand_ins > 0 and run["steps"][0][0] > 0
          and 0 < mfu < 0.9 * hfu)
    return ok, (f"{run['said']}; {stand_ins} stand-in values; "
                f"MFU {100 * mfu:.2f}% < HFU {100 * hfu:.2f}%")


def case_meta_classes(args):
    """Meta mode, FSDP x TP (llama.py --tp 2) on a 4x2 torus with wraparound: the
    tensor-parallel pairs are alike only every second chip along x, so the job runs again with
    one representative per class (2 processes), and its step times equal those of all 8 ranks
    run one process each; the ranks of the attempt stopped for it print nothing more."""
    run, error = beside_every_rank(args, "4x2", "--tp", "2", flags=[
        "--hardware", "v5e", "--set", "topology.wraparound=true"])
    if error:
        return False, error
    said = run["process"].stdout + run["process"].stderr
    regrouped = "running again with 2 representative ranks" in said
    # The first attempt's ranks, stopped for the regroup, say nothing (they printed
    # "the chip closed the connection" tracebacks).
    quiet = "closed the connection" not in said
    ok = (run["same"] and run["processes"] == (2, 8) and regrouped and quiet
          and run["steps"][0][-1] > 0)
    return ok, f"{run['said']}; regrouped: {regrouped}; the stopped attempt quiet: {quiet}"


def case_study(args):
    """`podsim study` sweeps a torch job like any other (scripts/studies/llama_torch.toml, cut
    to two pod sizes): one row per point with the program's step time, the rows' ranks forked
    from one rank server the study starts and ends."""
    out = tempfile.mkdtemp(prefix="podsim-torch-study-")
    study = os.path.join(out, "study.toml")
    with open(os.path.join(REPO, "scripts", "studies", "llama_torch.toml")) as f:
        text = f.read()
    text = text.replace('base = "llama_torch_base.toml"',
                        f'base = "{os.path.join(REPO, "scripts", "studies", "llama_torch_base.toml")}"')
    text = re.sub(r'(?m)^"topology.shape" = .*$', '"topology.shape" = ["2x2x2", "4x4x4"]', text)
    text = re.sub(r'(?m)^"job.eager" = .*$', '"job.eager" = ["fused"]', text)
    with open(study, "w") as f:
        f.write(text)
    # Not this harness's shared server: the study starts one for its rows.
    env = dict(os.environ, PODSIM_PYTHON=sys.executable)
    env.pop("PODSIM_RANK_SERVER", None)
    p, wall = run([args.podsim, "study", study, "--out", os.path.join(out, "runs")], env)
    shared = re.search(r"fork from one rank server \(podsim-rank-server-(\d+)-", p.stdout)
    server_gone = shared is not None and not _alive(int(shared.group(1)))
    rows = []
    path = os.path.join(out, "runs", "results.csv")
    if os.path.exists(path):
        import csv
        with open(path) as f:
            rows = list(csv.DictReader(f))
    steps = [float(r["step_ms"] or 0) for r in rows if r["status"] == "ok"]
    ok = p.returncode == 0 and len(steps) == 2 and all(x > 0 for x in steps) and server_gone
    return ok, (f"exit {p.returncode}, {len(rows)} rows, step ms {steps}, wall {wall:.1f} s, "
                f"one rank server for the rows: {shared is not None}, gone after: {server_gone}"
                f"{'' if ok else ': ' + p.stdout[-600:] + p.stderr[-300:]}")


def case_verify_ranks(args):
    """Meta mode at 4,096 chips: rank 1234 skips one backward; its shadow beside the
    representative is a desync naming rank 1234 and both lines."""
    p, wall, report = podsim_run(args, "16x16x16", "divergent.py", "--skip-rank", "1234",
                                 flags=["--mode", "meta", "--verify-ranks", "1234"])
    text = p.stdout + p.stderr
    status = (report or {}).get("status")
    named = "1234" in text and "divergent.py" in text
    # The verdict says how to run a program whose ranks differ by design.
    hinted = "--set job.symmetric=false" in text
    ok = p.returncode != 0 and status == "desync" and named and hinted
    line = next((l for l in text.splitlines() if "desync" in l.lower()), text[-400:])
    return ok, f"exit {p.returncode}, status {status}, wall {wall:.1f} s: {line[:500]}"


def case_out_of_hbm(args):
    """Meta mode: Llama-2-70B shapes on 8 chips do not fit a v5p's HBM: status error, naming
    the op and the program's line, with the bytes by kind."""
    p, wall, report = podsim_run(args, "2x2x2", "llama.py", "--model", "70b", "--batch", "4",
                                 "--seq", "4096", flags=["--mode", "meta", "--verify-ranks", "0"])
    text = p.stdout + p.stderr
    said = re.search(r"out of HBM: .* at aten\.\w+.* \(.*llama\.py:\d+ .*parameters [1-9]", text)
    status = (report or {}).get("status")
    ok = p.returncode != 0 and status == "error" and said is not None
    return ok, f"exit {p.returncode}, status {status}, wall {wall:.1f} s: {said.group(0)[:300] if said else text[-400:]}"


def case_trace(args):
    """`podsim run --trace`: a timeline of the program's chips, its collectives and the
    compute between them, as `podsim launch` writes one; tracing moves no virtual time."""
    trace = os.path.join(tempfile.mkdtemp(prefix="podsim-torch-"), "trace.json")
    p, wall, traced = podsim_run(args, "2x2", "ddp.py", "--steps", "3",
                                 flags=("--trace", trace))
    _, _, plain = podsim_run(args, "2x2", "ddp.py", "--steps", "3")
    if p.returncode != 0 or not os.path.exists(trace):
        return False, f"exit {p.returncode}, no trace: {p.stdout[-400:]}{p.stderr[-400:]}"
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    # Each chip's tracks are threads named "chip N [coordinates] ...".
    track_chip = {(e["pid"], e["tid"]): e["args"]["name"].split()[1] for e in events
                  if e.get("name") == "thread_name" and e["args"]["name"].startswith("chip ")}
    chips = {track_chip.get((e["pid"], e["tid"])) for e in spans} - {None}
    compute = sum(1 for e in spans if e["name"] == "the rank's kernels")
    collectives = sum(1 for e in spans if e["name"].startswith(("all-", "reduce-")))
    steps = lambda r: [s["virtual_ms"] for s in r["torch"]["steps"]]
    ok = len(chips) == 4 and compute > 0 and collectives > 0 and steps(traced) == steps(plain)
    return ok, (f"{len(chips)} chips traced, {compute} compute spans, {collectives} collective "
                f"spans; steps {steps(traced)} ms, untraced {steps(plain)} ms; wall {wall:.1f} s")


def case_replayed_steps(args, *script_args):
    """Steps replayed from the steady one have the virtual times, compute and HBM of the same
    steps counted op by op (`job.count=every`), the steps after rank 0's log lines (a
    `.item()` the steady step does not make) included; a step whose inputs change shape is
    caught and counted from that point (`partial`), and the steps after it are exact again."""
    # Past two recounts (`RECOUNT_EVERY` in python/podsim/_replay.py, made 12 here).
    steps, recount = 30, {"PODSIM_RECOUNT_EVERY": "12"}
    p1, _, steady = podsim_run(args, "2x2x2", "ddp.py", "--steps", str(steps), *script_args,
                               extra_env=recount)
    p2, _, every = podsim_run(args, "2x2x2", "ddp.py", "--steps", str(steps), *script_args,
                              flags=["--set", "job.count=every"])
    if p1.returncode or p2.returncode:
        return False, f"exits {p1.returncode}, {p2.returncode}: {p1.stdout[-600:]}{p2.stdout[-600:]}"
    kinds = [s["counting"] for s in steady["torch"]["ranks"][0]["steps"]]
    a, b = steady["torch"]["steps"], every["torch"]["steps"]
    # Times to 2e-4: two runs that both count every op differ now and then by one pass over a
    # small tensor on some rank (14 ns of a 137 us step; the fused chains depend on when
    # Python frees a storage), while a step that replayed one kernel too few or too many is
    # off by at least its launch (1 us, 7e-3 of this step). HBM within 5 %: a peak may include
    # a transient the stack sampler's thread held alive for a moment, in either run.
    tolerances = {"virtual_ms": 2e-4, "compute_ms": 2e-4, "exposed_comm_ms": 2e-4, "hfu": 2e-4,
                  "peak_hbm_bytes": 0.05}
    # The step whose batches change length: caught after its first torch call on them.
    changed = int(script_args[1].split(":")[0]) if script_args else None
    # The first step's HBM is left out: it holds the setup, whose temporaries Python frees
    # when it gets to them (counted in both runs, and different between runs of either).
    # Times are held to a fraction of the step's time, not of their own: a pass that shifts
    # by 14 ns shifts the exposed communication (a few us) by as much, and that is 4e-4 of it.
    def scale(step, field):
        return abs(step["virtual_ms"] if field.endswith("_ms") else step[field])

    differ = [(i, f, x[f], y[f]) for i, (x, y) in enumerate(zip(a, b)) if i != changed
              for f, tol in tolerances.items() if abs(x[f] - y[f]) > tol * scale(y, f) + 1e-9
              and (i, f) != (0, "peak_hbm_bytes")]
    partial = [i for i, k in enumerate(kinds) if k == "partial"]
    # Rank 0 logs at every fifth step, after its end.
    logged = [i for i in range(6, steps, 5)]
    # Counted: the steps until DDP's buckets settle and two agree (four), the logging
    # variant's first time, the two recounts, and, with a batch of another length, the steps
    # until two agree again.
    ok = (len(a) == len(b) == steps and not differ
          and set(partial) <= set(logged + ([changed] if changed else []))
          and kinds.count("replayed") >= steps - (7 if not changed else 10))
    return ok, (f"{kinds.count('counted')} counted, {kinds.count('replayed')} replayed, partial "
                f"{partial}; steps that differ from counting every op: {differ}")


def case_around_podsim(args):
    """A program whose collectives go around podsim (gloo, no interception) is an error: the
    smallest such program, an all-reduce over gloo (a model would only add import time)."""
    program = ("import torch, torch.distributed as dist\n"
               "dist.init_process_group('gloo')\n"
               "dist.all_reduce(torch.ones(4))\n"
               "dist.destroy_process_group()")
    p, wall, _ = run_inline(args, program, "--topology", "2", "--no-intercept")
    said = "no rank used podsim" in p.stdout + p.stderr
    return p.returncode != 0 and said, f"exit {p.returncode}; said why: {said}"


def run_inline(args, program, *flags):
    """`podsim run` of a program given as text (`python -c`): (process, wall, its report or
    `{}`)."""
    out = tempfile.mkdtemp(prefix="podsim-torch-")
    p, wall = run([args.podsim, "run", *flags, "--out", out, "--", sys.executable, "-c",
                   program])
    path = os.path.join(out, "report.json")
    if not os.path.exists(path):
        return p, wall, {}
    with open(path) as f:
        return p, wall, json.load(f)


def error_named(args, program, flags, pattern, exit_code=None):
    """`podsim run` of `program` (as text) with `flags` ends as status `error`, exiting
    non-zero (or with `exit_code`), its output matching `pattern`: (ok, what it said)."""
    p, wall, report = run_inline(args, program, *flags)
    status = report.get("status")
    text = p.stdout + p.stderr
    named = re.search(pattern, text) is not None
    exited = p.returncode != 0 if exit_code is None else p.returncode == exit_code
    ok = exited and status == "error" and named
    return ok, (f"exit {p.returncode}, status {status}, named: {named}, wall {wall:.1f} s: "
                f"{text[-300:]}")


def case_same_ranks_two_groups(args):
    """Two groups of the same ranks are two communicators: calls on one never meet calls on
    the other. Ranks issuing theirs in opposite orders wait on each other (a rank's calls run
    in issue order, async ones too), a deadlock named at its line - where the two groups had
    shared one sequence, and each rank's first call met the other's first: the job ended ok
    with the two tensors summed into each other."""
    program = ("import torch, torch.distributed as dist\n"
               "dist.init_process_group('gloo')\n"
               "rank, n = dist.get_rank(), dist.get_world_size()\n"
               "first = [dist.new_group([2 * i, 2 * i + 1]) for i in range(n // 2)][rank // 2]\n"
               "again = [dist.new_group([2 * i, 2 * i + 1]) for i in range(n // 2)][rank // 2]\n"
               "u, v = torch.ones(4), torch.full((4,), 100.0)\n"
               "calls = [(u, first), (v, again)][:: 1 if rank % 2 == 0 else -1]\n"
               "works = [dist.all_reduce(t, group=g, async_op=True) for t, g in calls]\n"
               "for w in works: w.wait()\n"
               "print('sums', u[0].item(), v[0].item())\n")
    p, wall, report = run_inline(args, program, "--topology", "2x2")
    text = p.stdout + p.stderr
    ok = (report.get("status") == "hang" and "deadlock" in text and "<string>:8" in text
          and "sums" not in p.stdout)
    return ok, f"exit {p.returncode}, status {report.get('status')}, wall {wall:.1f} s: {text[-400:]}"


def hang_told(args, program, flags, said, unsaid=(), most_s=None):
    """`podsim run` of `program` (as text) with `flags` ends as a hang (exit 3) whose output
    holds every text of `said` and none of `unsaid`, within `most_s` seconds if given."""
    p, wall, report = run_inline(args, program, *flags)
    text = p.stdout + p.stderr
    ok = (p.returncode == 3 and all(s in text for s in said)
          and not any(s in text for s in unsaid) and (most_s is None or wall < most_s))
    return ok, f"exit {p.returncode}, wall {wall:.1f} s: {text[-400:]}"


def case_rank_killed_by_sigkill(args):
    """A rank killed by SIGKILL (the out-of-memory killer, kill -9) is told as such: the rank's
    stub set a handler for the signal it was to end by, which for SIGKILL raises, and the rank
    was reported as "exited with code 1 (OSError: Invalid argument)"."""
    program = ("import os, torch.distributed as dist\n"
               "dist.init_process_group('gloo')\n"
               "dist.barrier()\n"
               "if dist.get_rank() == 2: os.kill(os.getpid(), 9)\n"
               "dist.barrier()\n")
    return hang_told(args, program, ["--topology", "2x2"],
                     ["Rank 2 (pid", "was killed by signal 9 (SIGKILL"], ["OSError"])


def case_busy_rank_is_a_hang(args):
    """A rank that loops for ever in its own code while its peers wait is a hang, named at its
    line once the busy limit passes: its CPU use had excused it for good (no diagnosis in
    120 s of a 2 s watchdog)."""
    program = ("import torch.distributed as dist\n"
               "dist.init_process_group('gloo')\n"
               "dist.barrier()\n"
               "while dist.get_rank() == 1: pass\n"
               "dist.barrier()\n")
    return hang_told(args, program, ["--topology", "2x2", "--set", "watchdog.busy_timeout_s=3"],
                     ["busy in its program's own work", "Rank 1's Python program is at <string>:4"],
                     most_s=30)


def case_meta_dtypes_priced_by_bytes(args):
    """Meta mode: a broadcast of bf16 and an all-reduce of int64 cost what float32 ones of the
    same bytes cost: both had run as an all-gather, charging the group's size times the data
    (4.5 s for a 0.5 GiB bf16 broadcast at 4,096 chips, summarised as an all-gather)."""
    def program(broadcast, reduced):
        return ("import torch, torch.distributed as dist\n"
                "dist.init_process_group('nccl')\n"
                "def sized(dt): return torch.zeros(2**27 // torch.empty(0, dtype=dt).element_size(), "
                "dtype=dt, device='cuda')\n"
                f"dist.broadcast(sized(torch.{broadcast}), src=0)\n"
                f"dist.all_reduce(sized(torch.{reduced}))\n")
    said = []
    for broadcast, reduced in (("bfloat16", "int64"), ("float32", "float32")):
        p, wall, report = run_inline(args, program(broadcast, reduced), "--topology", "16x16x16",
                                     "--mode", "meta")
        line = next((l for l in p.stdout.splitlines() if l.strip().startswith("rank 0:")), "")
        said.append(line.strip())
    ok = said[0] == said[1] and "broadcast x1" in said[0] and "all-reduce x1" in said[0]
    return ok, f"bf16 and int64: {said[0]!r}; float32: {said[1]!r}"


def case_rank_that_exits_early(args):
    """A rank that exits 0 before its peers' last collective is told as a rank gone while
    they wait, not as a chip whose program is stuck (a stuck kernel, a lock) at a line it
    never ran."""
    program = ("import sys, torch, torch.distributed as dist\n"
               "dist.init_process_group('gloo')\n"
               "x = torch.ones(4)\n"
               "for i in range(5):\n"
               "    if dist.get_rank() == 2 and i == 3: sys.exit(0)\n"
               "    dist.all_reduce(x)\n")
    return hang_told(args, program, ["--topology", "2x2"],
                     ["its program ended (rank 2 exited with code 0)", "after 3 collectives"],
                     ["Python program is at"])


def case_data_mode_allocation_past_hbm(args):
    """Data mode: an allocation past the chip's HBM (and past the host's memory) is the chip's
    out of HBM, raised before it allocates - it failed as the host's allocator's error."""
    program = ("import torch, torch.distributed as dist\n"
               "dist.init_process_group('gloo')\n"
               "x = torch.empty(int(60e9), dtype=torch.float32)\n")
    return error_named(args, program, ["--topology", "2x2"],
                       r"out of HBM: 0.00 GiB live and 223.52 GiB asked for on a v5p chip")


def case_verified_rank_fails_early(args):
    """Meta mode: a verified rank whose program fails before its process group (its arguments,
    an import) is a program error naming the rank and its exit, not a dead worker."""
    program = ("import os, sys\n"
               "if os.environ['RANK'] == '5': sys.exit('bad arguments')\n"
               "import torch.distributed as dist\n"
               "dist.init_process_group('nccl')\n"
               "dist.barrier()\n"
               "dist.destroy_process_group()")
    return error_named(args, program, ["--topology", "2x2x2", "--mode", "meta",
                                       "--verify-ranks", "5"],
                       r"Rank 5 \(pid \d+\) failed before it created its process group: it "
                       r"exited with code 1 \(its last words: \"bad arguments\"\)")


def case_representative_raises_beside_shadows(args):
    """Meta mode: a representative's exception, in a mesh of four classes with shadows of
    classes 1 and 2, is the program error naming it - not a desync of a shadow left waiting
    for calls its stopped representative never makes, nor a hang (both were so)."""
    program = ("import os, torch, torch.distributed as dist\n"
               "from torch.distributed.device_mesh import init_device_mesh\n"
               "n = int(os.environ['WORLD_SIZE'])\n"
               "mesh = init_device_mesh('cuda', (n // 4, 4), mesh_dim_names=('dp', 'tp'))\n"
               "x = torch.ones(8, device='cuda')\n"
               "dist.all_reduce(x, group=mesh['tp'].get_group())\n"
               "if dist.get_rank() == 0: raise RuntimeError('boom')\n"
               "dist.all_reduce(x)\n")
    return error_named(args, program, ["--topology", "4x4x4", "--mode", "meta",
                                       "--verify-ranks", "21,42"],
                       r"Rank 0 \(pid \d+\) raised RuntimeError: boom at <string>:7")


def case_every_rank_raises(args):
    """Meta mode: when every rank's program raises at the same line, the error names rank 0
    (the representative), not the verified rank that happened to exit first."""
    program = ("import torch.distributed as dist\n"
               "dist.init_process_group('nccl')\n"
               "dist.barrier()\n"
               "raise ValueError('every rank')\n")
    # podsim's last line names the rank whose error is the job's.
    return error_named(args, program, ["--topology", "4x4x4", "--mode", "meta",
                                       "--verify-ranks", "21,42"],
                       r"(?m)^podsim: Rank 0 \(pid \d+\) raised ValueError")


# Object collectives with rank-dependent objects (a pickle's length differs by rank) and a
# distributed checkpoint of an FSDP2 model, as training scripts gather metrics, share a
# config and save.
OBJECTS_PROGRAM = """
import os, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl")
r, n = dist.get_rank(), dist.get_world_size()
got = [None] * n
dist.all_gather_object(got, {"rank": r, "name": "x" * r})
assert len(got) == n and all(set(g) == {"rank", "name"} for g in got), got[:2]
gathered = [None] * n if r == 0 else None
dist.gather_object(("loss", 1.0), gathered, dst=0)
assert r != 0 or gathered == [("loss", 1.0)] * n, gathered
config = [{"lr": 3e-4, "steps": 2}] if r == 0 else [None]
dist.broadcast_object_list(config, src=0)
assert config == [{"lr": 3e-4, "steps": 2}], config
mine = [None]
dist.scatter_object_list(mine, [{"shard": i} for i in range(n)] if r == 0 else None, src=0)
assert mine == [{"shard": r}], mine
model = torch.nn.Linear(64, 64, device="cuda")
fully_shard(model)
model(torch.randn(8, 64, device="cuda")).sum().backward()
dcp.save({"model": model.state_dict()}, checkpoint_id=sys.argv[1])
dist.destroy_process_group()
"""


def case_object_collectives(args, mode):
    """Object collectives and a torch.distributed.checkpoint save: real in data mode; in meta
    mode (ranks verified against their representative) a gathered object is each rank's own,
    the verified ranks receive rank 0's broadcast and scatter, a save writes nothing, and the
    report lists the save - before, torch's unpickler met the meta device's missing bytes
    (EOFError) and a save failed."""
    out = tempfile.mkdtemp(prefix="podsim-torch-ckpt-")
    checkpoint = os.path.join(out, "checkpoint")
    flags = (["--topology", "2x2"] if mode == "data"
             else ["--topology", "4x4x4", "--mode", "meta", "--verify-ranks", "21,42"])
    p, wall, report = run_inline(args, OBJECTS_PROGRAM.replace("sys.argv[1]", repr(checkpoint)),
                                 *flags)
    status = report.get("status")
    saved = os.path.isdir(checkpoint) and any(f.endswith(".distcp") for f in os.listdir(checkpoint))
    listed = {what for rank in report.get("torch", {}).get("ranks", [])
              for what, _, _ in rank.get("stand_ins", [])}
    want_listed = {"torch.distributed.checkpoint.save"} if mode == "meta" else set()
    ok = (p.returncode == 0 and status == "ok" and saved == (mode == "data")
          and want_listed <= listed)
    return ok, (f"exit {p.returncode}, status {status}, checkpoint written: {saved}, stand-ins "
                f"{sorted(listed)}, wall {wall:.1f} s: {(p.stdout + p.stderr)[-300:]}")


# FSDP1 (the `FullyShardedDataParallel` wrapper, one unit per block), as Hugging Face
# accelerate and Lightning still wrap a model; torch refuses it on the CPU ("FSDP needs a
# non-CPU accelerator device"), so the reference is one process training on the global
# batch (`reference` in argv).
FSDP1_PROGRAM = """
import functools, sys, torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
D, V, T, B, STEPS, N = 64, 128, 16, 2, 3, 4
class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.norm, s.up, s.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
    def forward(s, x):
        return x + s.down(F.gelu(s.up(s.norm(x))))
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(V, D), Block(), Block(), nn.Linear(D, V))
reference = sys.argv[-1] == "reference"
if reference:
    ranks = range(N)
else:
    dist.init_process_group("nccl")
    ranks = [dist.get_rank()]
    torch.cuda.set_device(dist.get_rank())
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.cuda.current_device())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
gens = {r: torch.Generator().manual_seed(r) for r in ranks}
for step in range(STEPS):
    xs = {r: torch.randint(0, V, (B, T), generator=gens[r]).cuda() if not reference
          else torch.randint(0, V, (B, T), generator=gens[r]) for r in ranks}
    losses = {r: F.cross_entropy(model(x).flatten(0, 1), torch.roll(x, -1, 1).flatten())
              for r, x in xs.items()}
    (sum(losses.values()) / len(losses)).backward()
    opt.step(); opt.zero_grad()
    if 0 in losses:
        print(f"loss {losses[0].item():.7f}", flush=True)
"""


def case_fsdp1(args, mode):
    """FSDP1 runs: data mode's losses are one process's on the global batch; meta mode at 64
    chips completes. Before, FSDP1 refused podsim's device ("does not support CPU only
    execution"), then failed to free the storages a collective had read ("Trying to resize
    storage that is not resizable"), and in meta mode tried to materialise its parameters."""
    if mode == "data":
        ref = subprocess.run([sys.executable, "-c", FSDP1_PROGRAM, "reference"],
                             capture_output=True, text=True, timeout=DEADLINE_S)
        want = [float(x) for x in re.findall(r"^loss (\S+)", ref.stdout, re.M)]
        flags = ["--topology", "2x2"]
    else:
        want, flags = None, ["--topology", "4x4x4", "--mode", "meta"]
    p, wall, report = run_inline(args, FSDP1_PROGRAM, *flags)
    got = [float(x) for x in re.findall(r"^\[rank 0\] loss (\S+)", p.stdout + p.stderr, re.M)]
    steps = len(report.get("torch", {}).get("ranks", [{}])[0].get("steps", []))
    same = want is None or (len(want) == len(got) == 3 and all(
        abs(a - b) <= 1e-5 * abs(a) for a, b in zip(want, got)))
    ok = p.returncode == 0 and report.get("status") == "ok" and steps == 3 and same
    return ok, (f"exit {p.returncode}, status {report.get('status')}, steps {steps}, losses "
                f"{got} vs one process {want}, wall {wall:.1f} s: {(p.stdout + p.stderr)[-300:]}")


def case_cpu_offload_refused(args):
    """Meta mode refuses FSDP2's CPU offload by name (it would count host-resident shards as
    HBM), where torch said its parameters "should be materialized on CPU"."""
    program = ("import torch, torch.distributed as dist\n"
               "from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy\n"
               "dist.init_process_group('nccl')\n"
               "m = fully_shard(torch.nn.Linear(64, 64), offload_policy=CPUOffloadPolicy())\n"
               "m(torch.randn(8, 64))\n")
    return error_named(args, program, ["--topology", "2x2", "--mode", "meta"],
                       "meta mode does not model FSDP2's CPU offload", exit_code=1)


def case_torchrun_command(args):
    """`podsim run -- python -m torch.distributed.run --nproc-per-node 4 ... train.py` runs
    the script once per chip, as podsim launches ranks; torchrun's options are named as left
    out. Before, each chip started a torchrun of its own, whose ranks failed far from the
    cause ("nccl2 requires at least one CUDA device")."""
    out = tempfile.mkdtemp(prefix="podsim-torch-")
    script = os.path.join(out, "train.py")
    with open(script, "w") as f:
        f.write("import torch, torch.distributed as dist\n"
                "dist.init_process_group('nccl')\n"
                "x = torch.ones(4, device='cuda')\n"
                "dist.all_reduce(x)\n"
                "assert x.tolist() == [4.0] * 4, x\n"
                "dist.destroy_process_group()\n")
    p, wall = run([args.podsim, "run", "--topology", "2x2", "--out", out, "--", sys.executable,
                   "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                   script])
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    ranks = len(report.get("torch", {}).get("ranks", []))
    noted = "torchrun's own options were left out: --nproc-per-node 4 --standalone" in p.stderr
    ok = p.returncode == 0 and report.get("status") == "ok" and ranks == 4 and noted
    return ok, (f"exit {p.returncode}, status {report.get('status')}, {ranks} ranks, noted: "
                f"{noted}, wall {wall:.1f} s: {(p.stdout + p.stderr)[-300:]}")


# The mp.spawn launch (pytorch/examples' ddp-tutorial-series `multigpu.py`): run as `python
# train.py`, it spawns one process per device, each naming its rank and world size. With
# `reference` in argv it runs the same on gloo and the CPU (torch's own spawn).
SPAWN_PROGRAM = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
CPU = sys.argv[-1] == "reference"
def main(rank, world_size, steps):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
    if not CPU:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if CPU else "nccl", rank=rank, world_size=world_size)
    device = "cpu" if CPU else rank
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        model(torch.randn(8, 16, generator=g).to(device)).square().mean().backward()
        opt.step(); opt.zero_grad()
    print(f"rank {rank} final {sum(p.sum() for p in model.parameters()).item():.7f}", flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    world_size = 4 if CPU else torch.cuda.device_count()
    mp.spawn(main, args=(world_size, 3), nprocs=world_size)
"""


def free_port():
    """A loopback port nothing listens on now (for a reference run's own rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_spawned_ranks(args):
    """A program that starts its ranks with torch.multiprocessing.spawn runs one rank per
    chip (each podsim process runs its own index) and trains as under torch's spawn on gloo;
    on a pod of more chips than it spawns it is an error naming both counts. Before, the
    spawned children ran outside podsim ("Found no NVIDIA driver")."""
    out = tempfile.mkdtemp(prefix="podsim-torch-")
    script = os.path.join(out, "spawned.py")
    with open(script, "w") as f:
        f.write(SPAWN_PROGRAM)
    ref = subprocess.run([sys.executable, script, str(free_port()), "reference"],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    # The reference's four processes share a stream: lines can run into each other.
    finals = lambda text: sorted(re.findall(r"rank (\d) final (-?\d+\.\d{7})", text))
    p, wall = run([args.podsim, "run", "--topology", "2x2", "--out", out, "--", sys.executable,
                   script, "0"])
    big, _ = run([args.podsim, "run", "--topology", "2x2x2", "--out", out + "-8", "--",
                  sys.executable, script, "0"])
    named = "init_process_group(world_size=4) on a pod of 8 chips" in big.stdout + big.stderr
    want, got = finals(ref.stdout), finals(p.stdout)
    ok = p.returncode == 0 and len(want) == 4 and got == want and big.returncode != 0 and named
    return ok, (f"exit {p.returncode}, finals {got} vs torch's spawn {want}; 8 chips: exit "
                f"{big.returncode}, named {named}, wall {wall:.1f} s: {(p.stdout + p.stderr)[-200:]}")


def case_cuda_events_time(args, mode):
    """`torch.cuda.Event(enable_timing=True)` around a program's work reads the modelled time:
    around everything, the run's virtual time; around nothing, zero. It read 0.0 always."""
    program = ("import torch, torch.distributed as dist\n"
               "dist.init_process_group('nccl')\n"
               "e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]\n"
               "e[0].record()\n"
               "x = torch.randn(1024, 1024, device='cuda')\n"
               "for _ in range(4): x = x @ x\n"
               "dist.all_reduce(x)\n"
               "e[1].record(); e[2].record(); torch.cuda.synchronize()\n"
               "print('elapsed', e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2]), flush=True)\n"
               "dist.destroy_process_group()\n")
    p, wall, report = run_inline(args, program, "--topology", "2x2", "--mode", mode)
    found = re.search(r"\[rank 0\] elapsed (\S+) (\S+)", p.stdout)
    whole, none = (float(found[1]), float(found[2])) if found else (None, None)
    virtual_ms = report.get("virtual_s", 0) * 1e3
    ok = (p.returncode == 0 and whole is not None and whole > 0 and none == 0
          and abs(whole - virtual_ms) <= 0.01 * virtual_ms)
    return ok, (f"exit {p.returncode}: events {whole} and {none} ms, the run's virtual time "
                f"{virtual_ms:.4f} ms: {(p.stdout + p.stderr)[-200:]}")

# A mixture of experts with expert parallelism, routed as torchtitan routes it: each rank's
# counts of tokens per expert exchanged, read back as the split sizes of the all-to-all that
# moves the tokens; its layer checkpointed, with a tensor made on "cuda" inside.
MOE_PROGRAM = """
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils.checkpoint import checkpoint
dist.init_process_group("nccl")
n, T, D, E, K = dist.get_world_size(), 512, 64, 8, 2
router = torch.nn.Linear(D, E).cuda()
experts = torch.nn.Parameter(torch.randn(E // n, D, D, device="cuda") / D ** 0.5)

def layer(x):
    ids = router(x).topk(K, dim=-1).indices
    routing = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(-1, ids, True)
    counts = routing.sum(dim=0)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    send = counts.view(n, -1).sum(dim=1).tolist()
    recv = received.view(n, -1).sum(dim=1).tolist()
    order = torch.argsort(ids.view(-1), stable=True)
    routed = x[order // K]
    group = dist.group.WORLD
    out = funcol.all_to_all_single_autograd(routed, recv, send, group)
    out = torch.relu(out @ experts.mean(0))
    back = funcol.all_to_all_single_autograd(out, send, recv, group)
    return torch.zeros(T, D, device="cuda").index_add(0, order // K, back)

def local_experts(x):
    # Hugging Face's loop over the experts a batch hit: sizes read from a one-hot mask.
    ids = router(x).topk(K, dim=-1).indices
    mask = torch.nn.functional.one_hot(ids, num_classes=E).permute(2, 1, 0)
    out = torch.zeros_like(x)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        pos, token = torch.where(mask[e[0]])
        out.index_add_(0, token, x[token] @ experts[0])
    return out

x = torch.randn(T, D, device="cuda", requires_grad=True)
y = checkpoint(layer, x, use_reentrant=False) + local_experts(x)
y.square().mean().backward()
dist.destroy_process_group()
"""


def case_moe_counts(args, mode):
    """A mixture of experts' routed all-to-all and a loop over the experts hit run in `mode`;
    in meta mode the split sizes are balanced counts and the loop's sizes stand-ins, listed."""
    p, wall, report = run_inline(args, MOE_PROGRAM, "--topology", "2x2", "--mode", mode)
    ranks = (report.get("torch") or {}).get("ranks") or [{}]
    stand_ins = ranks[0].get("stand_ins", [])
    balanced = [s[1] for s in stand_ins if "balanced counts" in s[0]]
    sized = sorted({s[0] for s in stand_ins if "(its size)" in s[0]})
    meta = mode == "meta"
    ok = (p.returncode == 0 and report.get("status") == "ok"
          and bool(balanced) == meta and (sized == ["nonzero (its size)", "where (its size)"]) == meta)
    return ok, (f"exit {p.returncode}, status {report.get('status')}, balanced counts at "
                f"{balanced}, sizes stood in for: {sized}, wall {wall:.1f} s"
                f"{'' if ok else ': ' + (p.stdout + p.stderr)[-500:]}")


# Values a program puts on the device and reads back, as torch's pipelining and samplers do.
VALUES_PROGRAM = """
import pickle, torch, torch.distributed as dist
dist.init_process_group("nccl")
n = dist.get_world_size()
with torch.random.fork_rng(device_type="cuda"):
    torch.manual_seed(1)
vote = torch.tensor([0], dtype=torch.int32, device="cuda")
dist.all_reduce(vote, op=dist.ReduceOp.MIN)
counts = torch.tensor([1.0, 0.0, 2.0], device="cuda")
dist.all_reduce(counts)
data = torch.ByteTensor(torch.UntypedStorage.from_buffer(pickle.dumps("ok"), dtype=torch.uint8))
assert vote.item() == 0, vote.item()
assert counts.tolist() == [n * 1.0, 0.0, n * 2.0], counts.tolist()
assert pickle.loads(data.numpy().tobytes()) == "ok"
dist.destroy_process_group()
"""


def case_values_on_the_device(args, mode):
    """Small values put on the device keep them through collectives in meta mode (every rank
    alike), the accelerator's RNG state can be saved and restored, and a legacy constructor's
    host tensor stays on the host."""
    p, wall, report = run_inline(args, VALUES_PROGRAM, "--topology", "2x2", "--mode", mode)
    status = report.get("status")
    ok = p.returncode == 0 and status == "ok"
    return ok, f"exit {p.returncode}, status {status}, wall {wall:.1f} s: {(p.stdout + p.stderr)[-400:]}"


def case_meta_autocast(args):
    """Meta mode: autocast for the device a tensor is on (`x.device.type`, as a mixture of
    experts' router writes it) casts as on the accelerator."""
    program = ("import torch, torch.distributed as dist\n"
               "dist.init_process_group('nccl')\n"
               "x = torch.randn(256, 256, device='cuda')\n"
               "with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):\n"
               "    y = x @ x\n"
               "assert y.dtype == torch.bfloat16, y.dtype\n"
               "dist.all_reduce(y)\n"
               "dist.destroy_process_group()")
    p, wall, report = run_inline(args, program, "--topology", "2x2", "--mode", "meta")
    status = report.get("status")
    ok = p.returncode == 0 and status == "ok"
    return ok, f"exit {p.returncode}, status {status}, wall {wall:.1f} s: {(p.stdout + p.stderr)[-300:]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--podsim", default=os.path.join(REPO, "target", "debug", "podsim"))
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cases run at a time")
    ap.add_argument("--part", choices=("all", "untimed", "timed"), default="all",
                    help="the cases to run: all, those that time nothing, or those that time a "
                         "diagnosis or count processes")
    ap.add_argument("--fresh-references", action="store_true",
                    help="run torchrun again instead of using its kept results")
    args = ap.parse_args()
    args.podsim = os.path.abspath(args.podsim)
    # Every case runs `--jobs` at a time, each in its own folders and ports: much of a case's
    # wall is spent waiting (ranks starting, the store, a watchdog). The cases that time a
    # diagnosis or look for processes left behind hold their budgets beside another case
    # (their detection is the watchdog's quiet time, not CPU), and each counts only its own
    # processes.
    cases = [
        ("every supported call is right", lambda: case_api(args)),
        ("every supported call is right on 2 slices", lambda: case_api(args, "2x2", ["--slices", "2"])),
        ("ddp matches gloo", lambda: case_same_as_gloo(args, "ddp.py", "2x2x2")),
        ("fsdp2 matches gloo", lambda: case_same_as_gloo(args, "fsdp.py", "2x2x2")),
        ("dtensor and tp match gloo", lambda: case_same_as_gloo(args, "dtensor.py", "4x2")),
        ("pipeline (send/recv) matches gloo", lambda: case_same_as_gloo(args, "pipeline.py", "2x2x2")),
        ("an unedited llama (gloo, FSDP2, bf16) matches gloo",
         lambda: case_same_as_gloo(args, "llama.py", "2x2x2", tol=BF16_TOL)),
        ("an unedited llama under FSDP2 x tensor parallel (data mode) matches gloo",
         lambda: case_same_as_gloo(args, "llama.py", "4x2", tol=BF16_TOL, script_args=("--tp", "2"))),
        ("replayed steps time as counted ones", lambda: case_replayed_steps(args)),
        ("podsim run --trace draws the program's chips", lambda: case_trace(args)),
        ("a batch of another length is caught in replay",
         lambda: case_replayed_steps(args, "--seq-after", "12:8")),
        ("an unedited nccl/cuda DDP program runs, and in meta mode issues data mode's "
         "collectives and overlaps its buckets",
         lambda: case_meta_ddp(args)),
        ("meta mode: one representative times every rank", lambda: case_meta_representative(args)),
        ("data and meta mode price a step alike", lambda: case_data_and_meta_alike(args)),
        ("data and meta mode count an FSDP2 program's HBM alike",
         lambda: case_data_and_meta_hbm_alike(args)),
        ("data and meta mode count a DDP program's HBM alike",
         lambda: case_data_and_meta_ddp_hbm_alike(args)),
        ("podsim study sweeps a torch job", lambda: case_study(args)),
        ("meta mode: a representative per class times an FSDP x TP mesh",
         lambda: case_meta_classes(args)),
        ("a program around podsim is an error", lambda: case_around_podsim(args)),
        ("a torchrun command line runs its script once per chip",
         lambda: case_torchrun_command(args)),
        ("a program that spawns its ranks runs one per chip", lambda: case_spawned_ranks(args)),
        ("CUDA events time virtual milliseconds (data mode)",
         lambda: case_cuda_events_time(args, "data")),
        ("meta mode: CUDA events time virtual milliseconds",
         lambda: case_cuda_events_time(args, "meta")),
        ("meta mode: a rank that skips a backward is a desync", lambda: case_verify_ranks(args)),
        ("meta mode: 70B on 8 chips is out of HBM", lambda: case_out_of_hbm(args)),
        ("two groups of the same ranks are two communicators", lambda: case_same_ranks_two_groups(args)),
        ("a rank killed by SIGKILL is told as such", lambda: case_rank_killed_by_sigkill(args)),
        ("a rank busy for ever in its own code is a hang", lambda: case_busy_rank_is_a_hang(args)),
        ("a rank that exits early is told as gone", lambda: case_rank_that_exits_early(args)),
        ("data mode: an allocation past HBM is out of HBM", lambda: case_data_mode_allocation_past_hbm(args)),
        ("meta mode: collectives of any dtype are priced by their bytes",
         lambda: case_meta_dtypes_priced_by_bytes(args)),
        ("meta mode: a verified rank failing before its process group is a program error",
         lambda: case_verified_rank_fails_early(args)),
        ("meta mode: a representative's exception beside shadows of other classes is its error",
         lambda: case_representative_raises_beside_shadows(args)),
        ("meta mode: an exception on every rank names rank 0", lambda: case_every_rank_raises(args)),
        ("object collectives and a checkpoint save (data mode)",
         lambda: case_object_collectives(args, "data")),
        ("meta mode: object collectives and a checkpoint save",
         lambda: case_object_collectives(args, "meta")),
        ("FSDP1 matches one process on the global batch (data mode)",
         lambda: case_fsdp1(args, "data")),
        ("meta mode: FSDP1", lambda: case_fsdp1(args, "meta")),
        ("meta mode: FSDP2's CPU offload is refused by name",
         lambda: case_cpu_offload_refused(args)),
        ("meta mode: autocast on the tensor's own device", lambda: case_meta_autocast(args)),
        ("values put on the device (data mode)", lambda: case_values_on_the_device(args, "data")),
        ("meta mode: values put on the device are read back",
         lambda: case_values_on_the_device(args, "meta")),
        ("a mixture of experts' routed all-to-all, checkpointed (data mode)",
         lambda: case_moe_counts(args, "data")),
        ("meta mode: a mixture of experts gets balanced counts and stand-in sizes",
         lambda: case_moe_counts(args, "meta")),
    ]
    timed = [
        # Faults at different ranks and steps: an interior rank, the last rank, and rank 0
        # (which also hosts torch's store).
        ("a sleeping rank is a stalled chip", lambda: case_fault(args, "sleep", 3, 5, "stalled_chip", 3, 3000)),
        ("a skipped all-reduce is a desync", lambda: case_fault(args, "skip", 6, 3, "desync", 4, 1000)),
        ("a rank that exits is a dead worker", lambda: case_fault(args, "exit", 0, 8, "dead_worker", 3, 3000)),
        ("ranks that receive from each other beside finished ones are a deadlock",
         lambda: case_fault(args, "deadlock", 4, 5, "stalled_chip", 3, 3000)),
        ("a rank's exception is a program error, its steps kept",
         lambda: case_fault(args, "raise", 2, 4, "program_error", 1, 3000)),
        ("a rank that prints its error and exits 1 is a program error",
         lambda: case_fault(args, "handled", 5, 4, "program_error", 1, 3000)),
        ("a killed podsim leaves no rank, stub or rank server",
         lambda: case_killed_leaves_nothing(args, shared=False)),
        ("a killed podsim leaves no rank of a shared rank server",
         lambda: case_killed_leaves_nothing(args, shared=True)),
        ("a killed shared rank server fails its job at once", lambda: case_shared_server_killed(args)),
        ("a config's stall fault on a torch job", lambda: case_config_fault(args)),
        ("a stalled pipeline stage is named", lambda: case_config_fault(args, "pipeline.py", 5)),
    ]
    cases = cases if args.part != "timed" else []
    timed = timed if args.part != "untimed" else []
    cases = [c for c in cases if not args.only or args.only in c[0]]
    timed = [c for c in timed if not args.only or args.only in c[0]]
    # Every case's folders (reports, parameters) in one, removed when all passed and kept,
    # named, when one failed.
    tempfile.tempdir = tempfile.mkdtemp(prefix="podsim-torch-tests-")
    # One rank server for every podsim run here, as a user's scripted runs share one
    # (`python -m podsim.rank_server`): torch is imported once, not once per run (5-7 s of
    # CPU each). The case of a killed podsim checks a job's own server too.
    args.shared_server = shared_rank_server()
    try:
        failed = run_cases(cases + timed, args.jobs)
    finally:
        args.shared_server.stdin.close()  # the server ends with its input
        args.shared_server.wait(timeout=30)
    total = len(cases) + len(timed)
    if failed:
        print(f"the cases' folders are kept in {tempfile.tempdir}")
        # Named again at the end: with cases printed as they end, a failure early in the run
        # is far above the tail a CI log shows.
        for line in failed:
            print(line)
    else:
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)
    print(f"torch tests: {total - len(failed)} passed, {len(failed)} failed")
    sys.exit(len(failed))


def shared_rank_server():
    """Starts `python -m podsim.rank_server` (serving until its input ends) and names it in
    this process's environment, which every podsim run here inherits."""
    server = subprocess.Popen([sys.executable, "-m", "podsim.rank_server"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline().strip()
    name = line.partition("PODSIM_RANK_SERVER=")[2]
    if not name:
        server.kill()
        sys.exit(f"the shared rank server did not start: said {line!r}")
    os.environ["PODSIM_RANK_SERVER"] = name
    return server


def run_cases(cases, jobs):
    """Runs `cases` (name, function), `jobs` at a time, printing each as it ends; returns
    the lines of those that failed."""
    printing = threading.Lock()

    def one(case):
        name, fn = case
        started = time.monotonic()
        try:
            ok, detail = fn()
        except Exception as e:  # a case that breaks is a failure, not the end of the run
            ok, detail = False, f"{type(e).__name__}: {e}"
        took = time.monotonic() - started
        line = f"torch test {'ok' if ok else 'FAILED'}: {name}: {detail} [{took:.1f} s]"
        # One write under a lock: `print` writes the text and its newline apart, and two
        # cases ending together could share a line (hiding a FAILED from `grep ^`).
        with printing:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        return None if ok else line

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        return [line for line in pool.map(one, cases) if line]


if __name__ == "__main__":
    main()
