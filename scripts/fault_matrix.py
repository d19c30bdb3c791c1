#!/usr/bin/env python3
"""The watchdog's fault matrix: every fault kind, with its culprit at a corner, on a worker
boundary and in the interior of a torus, plus the cases that must not raise an alarm.

Each case is one `podsim launch` of a meta-mode all-reduce job (for `corrupt`, which needs
payloads to checksum, a small data-mode all-reduce with `verify = true`). `freeze` and `kill` are signals sent from
outside (SIGSTOP, SIGKILL) to the worker hosting the culprit once the job makes progress.
Prints one row per case: the kind found, the culprit (chip, worker), the detection time
(`hang.detected_after_ms` of report.json: from the fault taking effect to the diagnosis) and
whether it is right: the expected kind and culprit (and, with `--budget`, within the time
budget; the `budget` column shows it either way).

    scripts/fault_matrix.py --podsim target/release/podsim --shape 32x32x32 --workers 2
    scripts/fault_matrix.py --shape 48x48x48 --workers 4 --kinds stall,freeze
    scripts/fault_matrix.py --shape 8x8x8 --workers 2 --check   # exit 1 on a wrong kind or culprit

Positions assume the launcher's split of the torus into slabs along z (what it picks for
cubes on 2 or 4 workers): the boundary chip is the first z-layer of worker 1, the interior
chip the middle of worker 0's slab.
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

KINDS = ["stall", "crash", "freeze", "kill", "drop", "partition", "desync", "corrupt", "slow", "delay"]
EXPECTED = {
    "stall": "stalled_chip",
    "crash": "dead_worker",
    "freeze": "frozen_worker",
    "kill": "dead_worker",
    "drop": "lost_message",
    "partition": "partition",
    "desync": "desync",
    "corrupt": "corrupt",
    "slow": None,
    "delay": None,
}
# Which fault kinds are placed at a chip (the others at a worker, or everywhere).
AT_CHIP = {"stall", "drop", "desync", "corrupt", "slow", "delay", "crash", "freeze", "kill"}


def budget_ms(chips, kind):
    if kind == "desync":
        return 1000
    if chips <= 4096:
        return 3000
    if chips <= 32768:
        return 5000
    return 10000


def positions(dims, workers):
    x, y, z = dims
    slab = z // workers
    corner = (0, 0, 0)
    boundary = (x // 2, y // 2, slab)
    interior = (x // 2, y // 2, slab // 2)
    chip = lambda c: c[0] + x * (c[1] + y * c[2])
    return {"corner": (chip(corner), corner), "boundary": (chip(boundary), boundary), "interior": (chip(interior), interior)}


def worker_of(chip, chips, workers):
    return chip * workers // chips


def job(kind, shape, workers, chip, timeout_ms):
    # Signalled from outside once running: long enough not to finish first.
    iterations = 100000 if kind in ("freeze", "kill") else 6
    lines = [f'name = "matrix-{kind}"', "[topology]", f'shape = "{shape}"', 'hardware = "v5p"',
             "[launch]", f"workers = {workers}"]
    if kind == "corrupt":
        # Payloads to checksum: a small data-mode all-reduce with the debug checks on, along x
        # (the corrupted link's axis). Over the whole pod every chip's buffer would be padded
        # to a block per chip: 32,768 elements each on 32x32x32.
        lines += ["[job]", 'kind = "collectives"', 'mode = "data"', "iterations = 6", "verify = true",
                  "[[job.collectives]]", 'op = "all-reduce"', 'size = "4KiB"', 'group = "x"']
    else:
        lines += ["[job]", 'kind = "collectives"', 'mode = "meta"', f"iterations = {iterations}",
                  "[[job.collectives]]", 'op = "all-reduce"', 'size = "64MiB"']
    if timeout_ms:
        lines += ["[watchdog]", f"timeout_ms = {timeout_ms}"]
    fault = {
        "stall": f'kind = "stall"\nchip = {chip}\nat_seq = 3',
        "crash": f'kind = "crash"\nchip = {chip}\nat_seq = 3',
        "drop": f'kind = "drop"\nlink = "{chip}:+x"\nmode = "once"\nat_seq = 3',
        "partition": f'kind = "partition"\ngroups = [{[[w] for w in range(workers)]}]\nat_seq = 3'.replace("[[[", "[[").replace("]]]", "]]"),
        "desync": f'kind = "desync"\nchip = {chip}\nmode = "skip"\nat_seq = 3',
        "corrupt": f'kind = "corrupt"\nlink = "{chip}:+x"\nat_step = 2',
        "slow": f'kind = "slow"\nchip = {chip}\nfactor = 10',
        "delay": f'kind = "delay"\nlink = "{chip}:+y"\ndelay_ms = 20',
    }.get(kind)
    if fault:
        lines += ["[[faults]]", fault]
    return "\n".join(lines) + "\n"


def worker_pid(launch_pid, worker):
    """The pid of worker `worker` among the launcher's children (by its --worker-id), from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launch_pid:
                continue
            cmd = open(f"/proc/{entry}/cmdline").read().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if "--worker-id" in cmd and cmd[cmd.index("--worker-id") + 1] == str(worker):
            return int(entry)
    return None


def run_case(args, kind, where, chip, coord, dims, out_root):
    chips = dims[0] * dims[1] * dims[2]
    out = os.path.join(out_root, f"{kind}-{where}")
    cfg = os.path.join(out_root, f"{kind}-{where}.toml")
    with open(cfg, "w") as f:
        f.write(job(kind, args.shape, args.workers, chip, args.timeout_ms))
    start = time.monotonic()
    log = open(os.path.join(out_root, f"{kind}-{where}.log"), "w+")
    proc = subprocess.Popen([args.podsim, "launch", cfg, "--out", out], stdout=log, stderr=subprocess.STDOUT)
    signalled = None
    if kind in ("freeze", "kill"):
        # Once the job makes progress, signal the culprit's worker from outside.
        target = worker_of(chip, chips, args.workers)
        while proc.poll() is None and time.monotonic() - start < args.deadline:
            log.seek(0)
            if any(l.startswith("progress:") and not l.startswith("progress: 0/") for l in log):
                pid = worker_pid(proc.pid, target)
                if pid:
                    os.kill(pid, signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
                    signalled = pid
                    break
            time.sleep(0.05)
    try:
        code = proc.wait(timeout=max(1, args.deadline - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "timeout"
    if signalled and kind == "freeze":
        try:
            os.kill(signalled, signal.SIGKILL)
        except OSError:
            pass
    wall = time.monotonic() - start
    try:
        report = json.load(open(os.path.join(out, "report.json")))
    except (OSError, ValueError):
        report = {}
    hang = report.get("hang") or {}
    found = hang.get("kind")
    culprit = hang.get("culprit") or {}
    after = hang.get("detected_after_ms")
    expected = EXPECTED[kind]
    ok = found == expected
    if ok and expected in ("stalled_chip", "lost_message", "desync", "corrupt") and kind != "partition":
        ok = culprit.get("chip") == chip or (kind in ("desync", "corrupt") and culprit.get("chip") is not None)
    if ok and expected in ("dead_worker", "frozen_worker"):
        ok = culprit.get("worker") == worker_of(chip, chips, args.workers)
    in_budget = after is not None and after <= budget_ms(chips, kind)
    if ok and expected is not None and args.budget:
        ok = in_budget
    if expected is None:
        ok = code == 0
    return {
        "kind": kind, "where": where, "coord": coord, "chip": chip, "found": found or f"none (exit {code})",
        "culprit_chip": culprit.get("chip"), "culprit_worker": culprit.get("worker"),
        "detected_ms": after, "budget_ms": budget_ms(chips, kind) if expected else None,
        "in_budget": in_budget if expected else None,
        "wall_s": round(wall, 1), "exit": code, "ok": ok,
        "explanation": hang.get("explanation", ""),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--podsim", default="target/release/podsim")
    p.add_argument("--shape", default="32x32x32")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--where", default="corner,boundary,interior")
    p.add_argument("--timeout-ms", type=int, default=0, help="watchdog timeout (default: podsim's)")
    p.add_argument("--deadline", type=float, default=300, help="seconds a case may take")
    p.add_argument("--out", default=None)
    p.add_argument("--jobs", type=int, default=1,
                   help="cases run at once (detection times are then measured under each other's load)")
    p.add_argument("--json", action="store_true", help="one JSON object per case")
    p.add_argument("--check", action="store_true", help="exit 1 when a case is wrong")
    p.add_argument("--budget", action="store_true",
                   help="a case detected later than its budget is wrong too (a timing target: not for noisy CI machines)")
    args = p.parse_args()
    dims = [int(d) for d in args.shape.split("x")]
    if len(dims) != 3:
        sys.exit("--shape: a 3D torus like 32x32x32")
    if args.jobs < 1:
        sys.exit("--jobs: at least 1")
    out_root = args.out or tempfile.mkdtemp(prefix="podsim-matrix-")
    os.makedirs(out_root, exist_ok=True)
    pos = positions(dims, args.workers)
    rows = []
    if not args.json:
        print(f"{args.shape} on {args.workers} workers ({out_root})")
        print(f"{'fault':10} {'culprit at':10} {'coords':14} {'found':15} {'chip':>7} {'worker':>6} {'detected ms':>11} {'budget':>6} {'wall s':>6}  ok")
    cases = [(kind, where) for kind in args.kinds.split(",")
             for where in (args.where.split(",") if kind in AT_CHIP else ["-"])]

    def case(kind_where):
        kind, where = kind_where
        chip, coord = pos.get(where, (0, None))
        return run_case(args, kind, where, chip, coord, dims, out_root)

    # Cases run side by side (`--jobs`): a case mostly waits for its watchdog, so two at once
    # take half the wall time on two cores. Rows print in the matrix's order either way.
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for r in pool.map(case, cases):
            rows.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                det = "-" if r["detected_ms"] is None else f"{r['detected_ms']:.0f}"
                print(f"{r['kind']:10} {r['where']:10} {str(r['coord']):14} {r['found']:15} {str(r['culprit_chip']):>7} {str(r['culprit_worker']):>6} {det:>11} {(str(r['budget_ms']) + ('' if r['in_budget'] in (None, True) else '!')) if r['budget_ms'] else '-':>6} {r['wall_s']:>6}  {'yes' if r['ok'] else 'NO'}", flush=True)
    wrong = [r for r in rows if not r["ok"]]
    if not args.json:
        print(f"{len(rows) - len(wrong)} of {len(rows)} cases right")
        for r in wrong:
            print(f"  {r['kind']} at {r['where']}: {r['explanation'] or r['found']}")
    if not args.out:
        # The cases' reports are kept (and named) only when one was wrong.
        if wrong:
            print(f"the cases' reports are kept in {out_root}")
        else:
            shutil.rmtree(out_root, ignore_errors=True)
    if args.check and wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
